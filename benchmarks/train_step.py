"""A GPT-style model's training step under a memory limit (issue 12's benchmark), on this CPU.

The model and the hand-tuned peer are in ``train_step_model.py`` (4 pre-LN causal blocks, width
256, 4 heads, vocabulary 512), written two ways as users write it: a Python loop over the blocks
(``loop``) and ``lax.scan`` over the stacked blocks (``scan``, as with flax's ``nn.scan``), neither
with a checkpoint. Every measurement runs in a fresh process (``--worker``):

(a) ``reach``: under a fixed limit (512 MiB), the longest sequence (batch 1, L doubling from 256)
    and the largest batch (L=1024, batch doubling from 1) for which memsafe verifies a program and
    for which plain jax.jit's footprint (``memory_analysis()``) is under the limit; the footprints
    of both at each size (the plot);
(b) ``speed``: at batch 4, L=1024, the time per step (median of 3 after a first call) of plain
    jax.jit without a limit, of memsafe under arguments + outputs + a quarter of jax.jit's
    temporaries, and of the hand-written peer (``jax.checkpoint`` + ``lax.scan`` over stacked
    blocks + micro-batches, the fewest micro-batches whose footprint is under the same limit);
(c) the first call (trace, plan, compiles, one step) of memsafe and of jax.jit.

The machine is shared (2 cores): each result records the load average. ``python -m
benchmarks.train_step`` writes ``results/train-step.{json,md,png}``; ``--render`` redraws the table
and plot from the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
LIMIT_MIB = 512
#: A memsafe plan taking longer than this (seconds, one process) is recorded as a timeout.
WORKER_TIMEOUT_S = 420
MiB = 2**20


#: How the user wrote the model: the Python loop or ``lax.scan`` over stacked blocks.
WRITTEN = ("loop", "scan")


def _setup(batch: int, length: int, written: str = "loop") -> tuple[Any, Any, Any, Any]:
    """The model module, the user's loss as written, its parameters and a batch of tokens."""
    from benchmarks import train_step_model as gpt

    cfg = gpt.Config(batch=batch, length=length)
    params = gpt.init(cfg)
    if written == "scan":
        return gpt, gpt.scan_loss, gpt.stacked(params), gpt.tokens(cfg)
    return gpt, gpt.loss, params, gpt.tokens(cfg)


def _footprint(jitted: Any, *args: Any) -> int:
    from memsafe.xla import Footprint

    return Footprint.from_compiled(jitted.lower(*args).compile()).total


def _timed(fun: Callable[..., Any], *args: Any, repeats: int = 3) -> tuple[float, float, Any]:
    """The first call's seconds, the median of ``repeats`` calls after ``WARM_UP_CALLS``
    (benchmarks.measure), the last result."""
    import jax

    from benchmarks.measure import WARM_UP_CALLS

    start = time.perf_counter()
    out = jax.block_until_ready(fun(*args))
    first = time.perf_counter() - start
    for _ in range(WARM_UP_CALLS - 1):  # memsafe's trial of compile options
        out = jax.block_until_ready(fun(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fun(*args))
        times.append(time.perf_counter() - start)
    return first, statistics.median(times), out


def reach_worker(batch: int, length: int, written: str = "loop") -> dict[str, Any]:
    """jax.jit's footprints and memsafe's plan of one size under ``LIMIT_MIB``."""
    import jax

    import memsafe
    from memsafe.xla import memsafe_jit

    _, loss, params, ids = _setup(batch, length, written)
    grad = jax.value_and_grad(loss)
    out: dict[str, Any] = {
        "jax_mib": _footprint(jax.jit(grad), params, ids) / MiB,
        "jax_ynn_off_mib": _footprint(memsafe_jit(grad), params, ids) / MiB,
    }
    start = time.perf_counter()
    try:
        plan = memsafe.jit(grad, memory_limit=LIMIT_MIB * MiB).plan(params, ids)
        out.update(memsafe_mib=plan.after.total / MiB, splits=len(plan.splits))
        out["recompute_flops"] = plan.recompute_flops
        out["remat"] = any(r.pass_name == "remat" for r in plan.passes)
    except memsafe.MemoryLimitError as err:
        out["refused"] = str(err).splitlines()[0][:300]
        best = [ln for ln in str(err).splitlines() if "best footprint" in ln]
        out["best"] = best[0].strip() if best else ""
    out["plan_s"] = time.perf_counter() - start
    return out


def _hand_tuned(
    gpt: Any, stacked: Any, ids: Any, limit: int, jit: Callable[..., Any] | None = None
) -> tuple[Any, tuple, int, int]:  # fmt: skip
    """The peer (on stacked parameters) with the fewest micro-batches whose footprint is under
    ``limit``, compiled by ``jit`` (default ``jax.jit``, XLA's default options)."""
    import jax

    jit = jit or jax.jit
    fp = 0
    for micro in (1, 2, 4):
        fun = jit(lambda p, t, m=micro: gpt.hand_tuned_grad(p, t, m))
        fp = _footprint(fun, stacked, ids)
        if fp <= limit:
            break
    return fun, (stacked, ids), micro, fp


def speed_worker(batch: int, length: int, written: str = "loop") -> dict[str, Any]:
    """Times per step and first calls of jax.jit, memsafe and the hand-tuned peer."""
    import jax
    import numpy as np

    import memsafe
    from memsafe.xla import Footprint, memsafe_jit

    gpt, loss, params, ids = _setup(batch, length, written)
    grad = jax.value_and_grad(loss)
    plain = Footprint.from_compiled(jax.jit(grad).lower(params, ids).compile())
    limit = plain.arguments + plain.outputs + plain.temps // 4
    jax.clear_caches()
    out: dict[str, Any] = {"jax_mib": plain.total / MiB, "limit_mib": limit / MiB}
    out["jax_first_s"], out["jax_step_s"], want = _timed(jax.jit(grad), params, ids)
    safe = memsafe.jit(grad, memory_limit=limit)
    out["memsafe_first_s"], out["memsafe_step_s"], got = _timed(safe, params, ids)
    plan = safe.plan(params, ids)
    out.update(memsafe_mib=plan.after.total / MiB, attempts=len(plan.attempts))
    out["tuning"] = plan.tuning
    out["recompute_flops"] = plan.recompute_flops
    out["remat"] = any(r.pass_name == "remat" for r in plan.passes)
    out["loss_rel_diff"] = float(abs(got[0] - want[0]) / abs(want[0]))
    flat_got, flat_want = jax.tree.leaves(got[1]), jax.tree.leaves(want[1])
    out["grad_max_abs_diff"] = max(
        float(np.max(np.abs(a - b))) for a, b in zip(flat_got, flat_want)
    )
    stacked = params if written == "scan" else gpt.stacked(params)
    fun, args, micro, fp = _hand_tuned(gpt, stacked, ids, limit)
    out.update(hand_micro_batches=micro, hand_mib=fp / MiB)
    out["hand_first_s"], out["hand_step_s"], _ = _timed(fun, *args)
    # the same peer under memsafe's compile options (YNNPACK fusions off on the CPU)
    fun, args, micro, fp = _hand_tuned(gpt, stacked, ids, limit, memsafe_jit)
    out.update(hand_off_micro_batches=micro, hand_off_mib=fp / MiB)
    out["hand_off_first_s"], out["hand_off_step_s"], _ = _timed(fun, *args)
    return out


WORKERS: dict[str, Callable[..., dict[str, Any]]] = {
    "reach": reach_worker,
    "speed": speed_worker,
}


def _run(kind: str, batch: int, length: int, written: str = "loop") -> dict[str, Any]:
    """One worker in a fresh process; a timeout or crash is recorded, not raised."""
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    cmd = [sys.executable, "-m", "benchmarks.train_step", "--worker", kind, str(batch)]
    cmd += [str(length), written]
    base = {"batch": batch, "length": length, "written": written, "loadavg": os.getloadavg()}
    try:
        done = subprocess.run(
            cmd, capture_output=True, text=True, env=env, timeout=WORKER_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        return {**base, "timeout_s": WORKER_TIMEOUT_S}
    if done.returncode != 0:
        return {**base, "error": done.stderr.strip().splitlines()[-1][:300]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(kind, written, batch, length, json.dumps(result), flush=True)
    return {**base, **result, "loadavg_end": os.getloadavg()}


def _sweep(sizes: list[tuple[int, int]], written: str = "loop") -> list[dict[str, Any]]:
    """Reach results for ``sizes`` in order, stopping after the first size memsafe cannot do."""
    rows = []
    for batch, length in sizes:
        rows.append(_run("reach", batch, length, written))
        if "memsafe_mib" not in rows[-1]:
            break
    return rows


def measure() -> dict[str, Any]:
    import jax

    return {
        "limit_mib": LIMIT_MIB,
        "sequence": _sweep([(1, 256 * 2**k) for k in range(6)]),
        "sequence_scan": _sweep([(1, 256 * 2**k) for k in range(6)], "scan"),
        "batch": _sweep([(2**k, 1024) for k in range(6)]),
        "speed": _run("speed", 4, 1024),
        "speed_scan": _run("speed", 4, 1024, "scan"),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
    }


def _longest(rows: list[dict[str, Any]], key: str, size: str) -> int:
    """The largest ``size`` (batch or length) of the rows where ``key`` is under the limit."""
    ok = [r[size] for r in rows if r.get(key) is not None and r[key] <= LIMIT_MIB]
    return max(ok, default=0)


def _cell(row: dict[str, Any], key: str) -> str:
    if key in row:
        return f"{row[key]:,.0f}"
    if "refused" in row:
        best = row.get("best", "").replace("best footprint reached: ", "")
        return f"refused (best {best.split(' (')[0]})" if best else "refused"
    return "timeout" if "timeout_s" in row else row.get("error", "-")


def _reach_table(title: str, rows: list[dict[str, Any]], size: str) -> list[str]:
    lines = [
        f"### {title}",
        "",
        f"| {size} | jax.jit MiB | jax.jit (YNNPACK off) MiB | memsafe MiB | plan s | load |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        cells = [_cell(r, "jax_mib"), _cell(r, "jax_ynn_off_mib"), _cell(r, "memsafe_mib")]
        plan_s = f"{r['plan_s']:.0f}" if "plan_s" in r else "-"
        lines.append(f"| {r[size]} | {' | '.join(cells)} | {plan_s} | {r['loadavg'][0]:.1f} |")
    jit, ms = _longest(rows, "jax_mib", size), _longest(rows, "memsafe_mib", size)
    lines += ["", f"Largest {size} under {LIMIT_MIB} MiB: jax.jit {jit}, memsafe {ms}.", ""]
    return lines


def _speed_table(s: dict[str, Any]) -> list[str]:
    written = s.get("written", "loop")
    if "memsafe_step_s" not in s:
        return [f"### time per step ({written})", "", f"not measured: {s}", ""]
    rows = [
        ("jax.jit, no limit", s["jax_mib"], s["jax_first_s"], s["jax_step_s"]),
        (f"memsafe, limit {s['limit_mib']:.0f} MiB", s["memsafe_mib"], s["memsafe_first_s"],
         s["memsafe_step_s"]),
        (f"checkpoint + scan + {_batches(s['hand_micro_batches'])}", s["hand_mib"],
         s["hand_first_s"], s["hand_step_s"]),
    ]  # fmt: skip
    if "hand_off_step_s" in s:
        rows.append((
            f"the same, {_batches(s['hand_off_micro_batches'])}, memsafe's compile options "
            "(YNNPACK off)", s["hand_off_mib"], s["hand_off_first_s"], s["hand_off_step_s"],
        ))  # fmt: skip
    lines = [
        f"### time per step, the model written as a {written} (batch {s['batch']}, "
        f"L={s['length']})",
        "",
        "| program | footprint MiB | first call s | step s | step / jax.jit |",
        "|---|---|---|---|---|",
    ]
    for name, mib, first, step in rows:
        lines.append(
            f"| {name} | {mib:,.0f} | {first:.1f} | {step:.2f} | {step / s['jax_step_s']:.2f} |"
        )
    lines += [
        "",
        f"memsafe against the hand-written peer: {s['memsafe_step_s'] / s['hand_step_s']:.2f}x per "
        f"step{_against_off(s)}; first call "
        f"{s['memsafe_first_s'] / s['jax_first_s']:.1f}x jax.jit's "
        f"({s['attempts']} compile attempt(s)); estimated recompute "
        f"{s['recompute_flops']:.2g} flops{' (remat)' if s.get('remat') else ''}; "
        f"loss relative difference {s['loss_rel_diff']:.1e}, largest gradient difference "
        f"{s['grad_max_abs_diff']:.1e}; load average {s['loadavg'][0]:.1f} at the start.",
        "",
    ]
    if s.get("tuning"):
        lines += [f"memsafe's trial of compile options (memsafe.tuning): {s['tuning']}.", ""]
    return lines


def _batches(n: int) -> str:
    return f"{n} micro-batch{'es' if n != 1 else ''}"


def _against_off(s: dict[str, Any]) -> str:
    """memsafe against the peer compiled with memsafe's options, where measured."""
    if "hand_off_step_s" not in s:
        return ""
    return f" ({s['memsafe_step_s'] / s['hand_off_step_s']:.2f}x the peer at memsafe's options)"


def render(run: dict[str, Any]) -> str:
    head = [
        f"## GPT-style training step under a memory limit (jax {run['jax']}, "
        f"{run['cpu_count']} CPUs, shared machine: see the load column)",
        "",
        "Footprints from `memory_analysis()` (arguments + outputs + temps - aliases); memsafe's is",
        "the program it verified. Generated by `python -m benchmarks.train_step`.",
        "",
    ]
    seq = f"(a) longest sequence, batch 1, limit {LIMIT_MIB} MiB"
    lines = head + _reach_table(f"{seq}, Python loop", run["sequence"], "length")
    if "sequence_scan" in run:
        lines += _reach_table(f"{seq}, lax.scan", run["sequence_scan"], "length")
    batch = f"(a) largest batch, L=1024, limit {LIMIT_MIB} MiB, Python loop"
    lines += _reach_table(batch, run["batch"], "batch")
    lines += _speed_table(run["speed"])
    if "speed_scan" in run:
        lines += _speed_table(run["speed_scan"])
    return "\n".join(lines)


def plot(run: dict[str, Any], path: Path) -> None:
    """Footprint against sequence length, jax.jit and memsafe, with the limit."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    lines = [
        ("sequence", "jax_mib", "jax.jit, Python loop", "C0", "-"),
        ("sequence_scan", "jax_mib", "jax.jit, lax.scan", "C0", "--"),
        ("sequence", "memsafe_mib", "memsafe.jit, Python loop", "C1", "-"),
        ("sequence_scan", "memsafe_mib", "memsafe.jit, lax.scan", "C1", "--"),
    ]
    for rows, key, label, color, style in lines:
        pts = [(r["length"], r[key]) for r in run.get(rows, []) if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o", color=color, linestyle=style, label=label)
    ax.axhline(LIMIT_MIB, color="gray", linestyle="--", label="limit")
    ax.set(xscale="log", yscale="log", xlabel="sequence length (batch 1)", ylabel="footprint, MiB")
    ax.set_title("GPT-style training step: memory against sequence length")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=4, metavar=("KIND", "BATCH", "LENGTH", "WRITTEN"))
    parser.add_argument("--render", action="store_true", help="redraw md and png from the JSON")
    parser.add_argument(
        "--speed-only", action="store_true", help="measure the times per step again, keep the rest"
    )
    args = parser.parse_args()
    if args.worker:
        kind, batch, length, written = args.worker
        print(json.dumps(WORKERS[kind](int(batch), int(length), written)))
        return
    path = RESULTS / "train-step.json"
    if args.render or args.speed_only:
        run = json.loads(path.read_text())
        if args.speed_only:
            run.update(speed=_run("speed", 4, 1024), speed_scan=_run("speed", 4, 1024, "scan"))
    else:
        run = measure()
    path.write_text(json.dumps(run, indent=1) + "\n")
    (RESULTS / "train-step.md").write_text(render(run))
    plot(run, RESULTS / "train-step.png")


if __name__ == "__main__":
    main()
