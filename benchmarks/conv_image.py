"""A CNN's training step on one large image under a memory limit (halos across layers), on this
CPU.

The model: a fully convolutional network as users write it for dense prediction (segmentation,
denoising): ``DEPTH`` 3x3 convolutions with ReLU at full resolution, ``WIDTH`` channels, batch
1, a per-pixel squared loss; the step is ``jax.grad`` with respect to the kernels.

(a) ``reach``: under a fixed limit (``LIMIT_MIB``), the largest square image (side doubling from
    256) for which memsafe verifies a program, and for which jax.jit's footprint
    (``memory_analysis()``, YNNPACK off as memsafe compiles) is under the limit;
(b) ``speed``: at side 512, the time per step (median of 3 after a first call) of jax.jit without
    a limit, of memsafe under a third of jax.jit's footprint, and of the usual hand fix,
    ``jax.checkpoint`` around each layer (its footprint recorded: it still keeps every layer's
    input).

``python -m benchmarks.conv_image`` writes ``results/conv-image.{json,md}`` with the load average.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

RESULTS = Path(__file__).parent / "results"
LIMIT_MIB = 256
DEPTH, WIDTH = 6, 32
SIDES = (256, 512, 1024, 2048)
MiB = 2**20


def _conv(h: Any, w: Any) -> Any:
    dn = ("NHWC", "HWIO", "NHWC")
    return lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=dn)


def loss(ws: list[Any], x: Any, target: Any) -> Any:
    """The network as users write it: a Python loop over the layers."""
    h = x
    for w in ws[:-1]:
        h = jax.nn.relu(_conv(h, w))
    return jnp.mean((_conv(h, ws[-1]) - target) ** 2)


def checkpointed_loss(ws: list[Any], x: Any, target: Any) -> Any:
    """The usual hand fix: ``jax.checkpoint`` around each layer."""
    layer = jax.checkpoint(lambda h, w: jax.nn.relu(_conv(h, w)))
    h = x
    for w in ws[:-1]:
        h = layer(h, w)
    return jnp.mean((_conv(h, ws[-1]) - target) ** 2)


def inputs(side: int, seed: int = 0) -> tuple[list[Any], Any, Any]:
    rng = np.random.default_rng(seed)
    shapes = [(3, 3, 3, WIDTH)] + [(3, 3, WIDTH, WIDTH)] * (DEPTH - 2) + [(3, 3, WIDTH, 3)]
    scale = [(2 / (9 * s[2])) ** 0.5 for s in shapes]  # He initialisation
    ws = [jnp.asarray(rng.standard_normal(s) * c, jnp.float32) for s, c in zip(shapes, scale)]
    x = jnp.asarray(rng.standard_normal((1, side, side, 3)), jnp.float32)
    return ws, x, jnp.asarray(rng.standard_normal((1, side, side, 3)), jnp.float32)


def _footprint(fun: Any, *args: Any) -> int:
    from memsafe.xla import Footprint, memsafe_jit

    return Footprint.from_compiled(memsafe_jit(fun).lower(*args).compile()).total


def _timed(fun: Any, *args: Any, repeats: int = 3) -> tuple[float, float]:
    """(first call s, median of ``repeats`` later calls s)."""
    start = time.perf_counter()
    jax.block_until_ready(fun(*args))
    first = time.perf_counter() - start
    jax.block_until_ready(fun(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fun(*args))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def reach() -> list[dict[str, Any]]:
    import memsafe

    step = jax.grad(loss)
    rows = []
    for side in SIDES:
        args = inputs(side)
        row: dict[str, Any] = {"side": side, "jit_mib": _footprint(step, *args) / MiB}
        start = time.perf_counter()
        try:
            plan = memsafe.jit(step, memory_limit=f"{LIMIT_MIB}MiB").plan(*args)
            row["memsafe_mib"] = plan.after.total / MiB
        except memsafe.MemoryLimitError:
            row["memsafe_mib"] = None
        row["plan_s"] = time.perf_counter() - start
        row["load"] = os.getloadavg()[0]
        rows.append(row)
        print(row, flush=True)
    return rows


def speed(side: int = 512) -> dict[str, Any]:
    import memsafe
    from memsafe.xla import memsafe_jit

    args = inputs(side)
    step = jax.grad(loss)
    plain = _footprint(step, *args)
    limit = plain // 3
    safe = memsafe.jit(step, memory_limit=limit)
    plan = safe.plan(*args)
    out = {"side": side, "load_start": os.getloadavg()[0], "limit_mib": limit / MiB}
    out["jit"] = dict(zip(("first_s", "step_s"), _timed(memsafe_jit(step), *args)))
    out["jit"]["mib"] = plain / MiB
    out["memsafe"] = dict(zip(("first_s", "step_s"), _timed(safe, *args)))
    out["memsafe"] |= {"mib": plan.after.total / MiB, "splits": [s.describe() for s in plan.splits]}
    ckpt = jax.grad(checkpointed_loss)
    out["checkpoint"] = dict(zip(("first_s", "step_s"), _timed(memsafe_jit(ckpt), *args)))
    out["checkpoint"]["mib"] = _footprint(ckpt, *args) / MiB
    got, want = safe(*args), memsafe_jit(step)(*args)
    out["largest_gradient_difference"] = max(
        float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(got, want)
    )
    out["load_end"] = os.getloadavg()[0]
    print(out, flush=True)
    return out


def render(data: dict[str, Any]) -> str:
    lines = [
        "## A CNN's training step on one image (jax 0.10.2, 2 CPUs)",
        "",
        f"{DEPTH} 3x3 conv layers (ReLU), width {WIDTH}, batch 1, per-pixel squared loss, "
        "`jax.grad` over the kernels. Footprints from `memory_analysis()` (YNNPACK off). "
        "Generated by `python -m benchmarks.conv_image`.",
        "",
        f"### (a) largest image under {LIMIT_MIB} MiB",
        "",
        "| side | jax.jit MiB | memsafe MiB | plan s | load |",
        "|---|---|---|---|---|",
    ]
    for r in data["reach"]:
        ms = "refused" if r["memsafe_mib"] is None else f"{r['memsafe_mib']:,.0f}"
        lines.append(
            f"| {r['side']} | {r['jit_mib']:,.0f} | {ms} | {r['plan_s']:.1f} | {r['load']:.1f} |"
        )
    fits = [r["side"] for r in data["reach"] if r["jit_mib"] <= LIMIT_MIB]
    safe = [r["side"] for r in data["reach"] if r["memsafe_mib"] is not None]
    lines += [
        "",
        f"Largest side under {LIMIT_MIB} MiB: jax.jit {max(fits, default='none')}, "
        f"memsafe {max(safe, default='none')}.",
        "",
    ]
    s = data["speed"]
    base = s["jit"]["step_s"]
    lines += [
        f"### time per step at {s['side']}x{s['side']} (memsafe under a third of jax.jit's "
        "footprint)",
        "",
        "| program | footprint MiB | first call s | step s | step / jax.jit |",
        "|---|---|---|---|---|",
    ]
    names = {
        "jit": "jax.jit, no limit",
        "memsafe": f"memsafe, limit {s['limit_mib']:.0f} MiB",
        "checkpoint": "jax.checkpoint around each layer",
    }
    for key, name in names.items():
        r = s[key]
        lines.append(
            f"| {name} | {r['mib']:,.1f} | {r['first_s']:.2f} | {r['step_s']:.3f} | "
            f"{r['step_s'] / base:.2f} |"
        )
    lines += [
        "",
        f"memsafe's split: {'; '.join(s['memsafe']['splits'])}",
        "",
        f"Largest gradient difference (relative to the largest gradient): "
        f"{s['largest_gradient_difference']:.1e}; load average {s['load_start']:.1f} at the "
        f"start, {s['load_end']:.1f} at the end.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    data = {"reach": reach(), "speed": speed()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "conv-image.json").write_text(json.dumps(data, indent=1))
    (RESULTS / "conv-image.md").write_text(render(data))


if __name__ == "__main__":
    main()
