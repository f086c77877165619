"""Which of XLA's YNNPACK fusion types memsafe could trust on the CPU (issue 14, item 1).

For the product of a kNN chunk (10,000 queries x 8,192 points x 64, float32) and four forms of
what follows it, under each setting of ``xla_cpu_experimental_ynn_fusion_type`` (none: memsafe's
compile; each type alone; DOT with REDUCE), in a fresh process each: the rate (GFLOP/s, best of
three calls after a warm-up), the temporaries ``memory_analysis()`` reports, and the growth of
the process's peak RSS over the calls (what the program really allocated beyond its arguments).
A setting is trustworthy for a form where the RSS growth stays within the reported temporaries
and outputs.

``python -m benchmarks.ynn_types`` writes ``results/ynn-types.json`` and ``results/ynn-types.md``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
N, M, D = 10_000, 8_192, 64
SETTINGS = (
    "",
    "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT",
    "LIBRARY_FUSION_TYPE_DOT",
    "LIBRARY_FUSION_TYPE_REDUCE",
    "LIBRARY_FUSION_TYPE_DOT,LIBRARY_FUSION_TYPE_REDUCE",
)
#: Growth of the process beyond what memory_analysis() reports that still counts as accounted for
#: (allocator and thread-pool noise); the hidden buffers at stake are whole products, 313 MiB.
SLACK = 48 * 2**20
FORMS = ("product", "row max", "block max of 128", "tiles of 256, block max of 32")


def _forms():
    import jax.numpy as jnp
    from jax import lax

    def tiled(x, y):
        def tile(yt):
            return jnp.max((x @ yt.T).reshape(N, 8, 32), -1)

        return lax.map(tile, y.reshape(M // 256, 256, D))

    return {
        "product": lambda x, y: x @ y.T,
        "row max": lambda x, y: jnp.max(x @ y.T, -1),
        "block max of 128": lambda x, y: jnp.max((x @ y.T).reshape(N, M // 128, 128), -1),
        "tiles of 256, block max of 32": tiled,
    }


def measure(setting: str, form: str) -> dict:
    """One (setting, form) in this process: rate, reported temps, peak RSS growth."""
    import resource
    import time

    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((N, D), dtype=np.float32))
    y = jax.device_put(rng.standard_normal((M, D), dtype=np.float32))
    options = {"xla_cpu_experimental_ynn_fusion_type": setting}
    small = jax.jit(_forms()["row max"], compiler_options=options)
    jax.block_until_ready(small(x[:256], y[:256]))  # the runtime's own start-up, not counted
    compiled = jax.jit(_forms()[form], compiler_options=options).lower(x, y).compile()
    analysis = compiled.memory_analysis()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    jax.block_until_ready(compiled(x, y))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(compiled(x, y))
        best = min(best, time.perf_counter() - start)
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    return {
        "setting": setting or "none",
        "form": form,
        "gflops": 2 * N * M * D / best / 1e9,
        "temps": analysis.temp_size_in_bytes,
        "outputs": analysis.output_size_in_bytes,
        "rss_growth": grown,
    }


def _row(r: dict) -> str:
    mib = 2**20
    hidden = r["rss_growth"] - r["temps"] - r["outputs"]
    flag = "hidden" if hidden > SLACK else "counted"
    return (
        f"| {r['setting']} | {r['form']} | {r['gflops']:.0f} | {r['temps'] / mib:.1f} | "
        f"{r['rss_growth'] / mib:.1f} | {flag} |"
    )


def main() -> None:
    if len(sys.argv) == 3:  # a worker: one measurement, printed as JSON
        print(json.dumps(measure(sys.argv[1], sys.argv[2])))
        return
    rows = []
    for setting in SETTINGS:
        for form in FORMS:
            out = subprocess.run(
                [sys.executable, "-m", "benchmarks.ynn_types", setting, form],
                capture_output=True, text=True, check=True, env=dict(os.environ),
            )  # fmt: skip
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(_row(rows[-1]), flush=True)
    record = {"n": N, "m": M, "d": D, "loadavg": os.getloadavg(), "rows": rows}
    (RESULTS / "ynn-types.json").write_text(json.dumps(record, indent=1))
    lines = [
        "# YNNPACK fusion types on a kNN chunk's product",
        "",
        f"{N:,} x {M:,} x {D}, float32, one process per row, load average "
        f"{record['loadavg'][0]:.1f}. `hidden`: the process grew by more than the temporaries "
        "and outputs `memory_analysis()` reports, with 48 MiB of slack for the allocator.",
        "",
        "| fusion types | form | GFLOP/s | temps MiB | RSS growth MiB | memory |",
        "|---|---|---|---|---|---|",
        *(_row(r) for r in rows),
        "",
    ]
    (RESULTS / "ynn-types.md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
