"""ott-jax's Sinkhorn as its users call it: memsafe against ott's own online mode (issue 41).

The program is ott's ``Sinkhorn`` on a ``PointCloud`` (its cost matrix made once, read by every
iteration), the regularized transport cost, a fixed number of iterations (``threshold=-1``,
``min_iterations = max_iterations``) so that every method does the same work:

- ``memsafe``: ``memsafe.jit`` of that program under a limit (the cost matrix recomputed in
  chunks inside each iteration);
- ``online``: ott's own online mode, ``PointCloud(..., batch_size=2048)``, its hand-tuned
  chunking, under ``jax.jit``. It does not run on JAX 0.10 (ott 0.6.0 calls
  ``jax.interpreters.batching.is_vmappable``, which JAX 0.10 removed), so it runs in an
  environment of its own with JAX 0.7.2 (``benchmarks/.envs/ott``, made on first use);
- ``jax``: ``jax.jit`` of the program, where its cost matrix fits (``--jax-max`` bytes).

Each method runs in a fresh process: a compile (memsafe: the plan, every attempt and the
verification), then one timed call; the process's peak RSS and memsafe's verified footprint are
kept. ``python -m benchmarks.ott_online [--sizes 8000x10000,48000x60000] [--iterations 10]``
writes ``results/ott-online.{json,md}`` with the load average (run it alone on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.side_env import SideEnv

RESULTS = Path(__file__).parent / "results"
#: ott-jax 0.6.0 with the newest JAX its online mode runs on.
ENV = SideEnv(
    "ott",
    ("jax[cpu]==0.7.2", "ott-jax==0.6.0"),
    probe="import ott, jax.interpreters.batching as b; b.is_vmappable",
)
BATCH = 2048
EPSILON = 0.5


def _points(n: int, m: int) -> tuple[Any, Any]:
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 3)).astype(np.float32)
    y = (rng.standard_normal((m, 3)) + 0.5).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def _cost(iterations: int, batch: int | None) -> Any:
    from ott.geometry import pointcloud
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn

    solver = sinkhorn.Sinkhorn(threshold=-1.0, min_iterations=iterations, max_iterations=iterations)

    def cost(x: Any, y: Any) -> tuple[Any, Any]:
        geom = pointcloud.PointCloud(x, y, epsilon=EPSILON, batch_size=batch)
        out = solver(linear_problem.LinearProblem(geom))
        return out.reg_ot_cost, out.n_iters

    return cost


def worker(method: str, n: int, m: int, iterations: int, limit: str) -> dict[str, Any]:
    """One fresh process: compile ``method``'s program, then time one call."""
    import jax

    jax.block_until_ready(jax.jit(lambda v: v + 1)(1.0))  # the backend started
    x, y = _points(n, m)
    cost = _cost(iterations, BATCH if method == "online" else None)
    out: dict[str, Any] = {"jax": jax.__version__, "loadavg": os.getloadavg()}
    start = time.perf_counter()
    if method == "memsafe":
        import memsafe

        fun = memsafe.jit(cost, memory_limit=limit)
        fun.lower(x, y).compile()
        plan = fun.plan(x, y)
        out["footprint"] = plan.after.total if plan.after else plan.before.total
        out["splits"] = [(s.chunk, s.loops) for s in plan.splits]
    else:
        fun = jax.jit(cost).lower(x, y).compile()
    out["compile_s"] = time.perf_counter() - start
    start = time.perf_counter()
    value, iters = jax.block_until_ready(fun(x, y))
    out["run_s"] = time.perf_counter() - start
    out["value"], out["iterations"] = float(value), int(iters)
    # benchmarks.measure.peak_rss, which the peer's environment cannot import (it imports memsafe)
    out["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _run(method: str, n: int, m: int, iterations: int, limit: str) -> dict[str, Any]:
    python = ENV.ensure() if method == "online" else Path(sys.executable)
    root = Path(__file__).resolve().parent.parent
    # the repository root holds no memsafe (it is under src/): the peer's JAX stays its own
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(root)}
    cmd = [str(python), "-m", "benchmarks.ott_online", "--worker", method]
    cmd += [str(n), str(m), str(iterations), limit]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        return {"error": done.stderr[-2000:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(sizes: list[tuple[int, int]], iterations: int, limit: str, jax_max: int) -> dict:
    rows = []
    start_load = os.getloadavg()
    for n, m in sizes:
        methods = ["memsafe", "online"] + (["jax"] if n * m * 4 <= jax_max else [])
        row: dict[str, Any] = {"n": n, "m": m, "cost_matrix_bytes": n * m * 4}
        for method in methods:
            row[method] = _run(method, n, m, iterations, limit)
            print(n, m, method, row[method], flush=True)
        rows.append(row)
    return {
        "iterations": iterations,
        "limit": limit,
        "batch_size": BATCH,
        "loadavg_start": start_load,
        "loadavg_end": os.getloadavg(),
        "rows": rows,
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "# ott-jax's Sinkhorn: memsafe against ott's online mode (issue 41)",
        "",
        f"`python -m benchmarks.ott_online`: {result['iterations']} Sinkhorn iterations "
        f"(fixed), epsilon {EPSILON}, d = 3; memsafe under {result['limit']} (JAX of this "
        f"environment), ott's online mode with `batch_size={result['batch_size']}` (JAX 0.7.2, "
        "its own environment). A fresh process per cell: compile, then one timed call. Load "
        f"average {_load(result['loadavg_start'])} at the start, {_load(result['loadavg_end'])} "
        "at the end.",
        "",
        "| n x m | cost matrix | method | JAX | compile | run | per iteration | online / this "
        "| peak RSS | footprint | value |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        online = row.get("online", {}).get("run_s")
        for method in ("memsafe", "online", "jax"):
            cell = row.get(method)
            if cell is None:
                continue
            head = f"| {row['n']:,} x {row['m']:,} | {row['cost_matrix_bytes'] / 2**30:.2f} GiB "
            if "error" in cell:
                lines.append(head + f"| {method} | | failed: {cell['error'][-120:]!r} |||||||")
                continue
            ratio = f"{online / cell['run_s']:.2f}x" if online else ""
            fp = f"{cell['footprint'] / 2**20:.1f} MiB" if "footprint" in cell else ""
            lines.append(
                head + f"| {method} | {cell['jax']} | {cell['compile_s']:.1f} s "
                f"| {cell['run_s']:.1f} s | {cell['run_s'] / result['iterations']:.2f} s "
                f"| {ratio} | {cell['peak_rss'] / 2**30:.2f} GiB | {fp} | {cell['value']:.6f} |"
            )
    return "\n".join(lines) + "\n"


def _load(avg: Any) -> str:
    return ", ".join(f"{a:.2f}" for a in avg)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=5, metavar=("METHOD", "N", "M", "ITERS", "LIMIT"))
    parser.add_argument("--sizes", default="8000x10000,48000x60000")
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--limit", default="1GiB")
    parser.add_argument("--jax-max", type=int, default=2 << 30, help="cost matrix bytes")
    args = parser.parse_args(argv)
    if args.worker:
        method, n, m, iters, limit = args.worker
        print(json.dumps(worker(method, int(n), int(m), int(iters), limit)))
        return 0
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    result = measure(sizes, args.iterations, args.limit, args.jax_max)  # type: ignore[arg-type]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ott-online.json").write_text(json.dumps(result, indent=1) + "\n")
    (RESULTS / "ott-online.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
