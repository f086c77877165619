"""Two checkouts of memsafe against each other: the quick programs in paired whole-process runs.

A change that should not change what memsafe does (issue 40's redesign) must not make it slower.
Each program runs in a fresh process under the memsafe of one checkout (``PYTHONPATH`` set to its
``src``; this repository's ``benchmarks`` package for both): import, plan, the first call, then
five timed calls. After one warm-up process of each side, ``--pairs`` pairs run, the order
alternating (after first in even pairs), and each pair gives the ratio after / before of the whole
process's wall time, of the plan and first call, and of the median steady call. The medians of
the ratios over the pairs are the result.

Programs (a memsafe function under a limit each, as in the quick benchmarks):

- ``knn``: expanded L2 k-nearest neighbours, 1k queries x 100k points x 64, k = 10, 64 MiB;
- ``kernel_matvec``: a Gaussian kernel matrix times a vector, n = m = 20k, d = 3, 64 MiB;
- ``attention`` and ``attention_grad``: softmax attention, 8 heads, L = 2048, d = 64, its forward
  and its value and gradient, 256 MiB;
- ``train_step``: the GPT-style model of ``train_step_model.py`` (4 blocks, width 256), the value
  and gradient of its loss at batch 1, L = 512, under arguments + outputs + half of jax.jit's
  temporaries;
- ``conv_step``: the gradient of ``conv_image.py``'s 6-layer CNN on one 256 x 256 image, under a
  third of jax.jit's footprint.

``python -m benchmarks.paired --before DIR --after DIR [--pairs 5] [--programs a,b] [--out NAME]``
writes ``results/NAME.{json,md}`` (default ``paired``) with the load average. Run it alone on a
quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
PROGRAMS = ("knn", "kernel_matvec", "attention", "attention_grad", "train_step", "conv_step")
REPEATS = 5


def _fixed_and_temps(fun: Any, args: tuple) -> tuple[int, int]:
    """jax.jit's arguments + outputs - aliases, and its temporaries (memory_analysis)."""
    import jax

    m = jax.jit(fun).lower(*args).compile().memory_analysis()
    fixed = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return fixed, m.temp_size_in_bytes


def _program(name: str) -> tuple[Any, tuple, Any]:
    """(function, arguments, limit) of one program."""
    import functools

    import jax
    import numpy as np

    if name == "knn":
        from examples import knn as ex

        x, y = ex.make_inputs(1000, 100_000, 64)
        fun = functools.partial(ex.FUNCTIONS["l2_expanded"], k=10)
        return fun, (jax.numpy.asarray(x), jax.numpy.asarray(y)), "64MiB"
    if name == "kernel_matvec":
        from benchmarks.kernel_matvec import LENGTHSCALE
        from examples import kernel_matvec as ex

        x, y, v = ex.make_inputs(20_000, 20_000, 3)
        args = (*(jax.numpy.asarray(a) for a in (x, y, v)), np.float32(LENGTHSCALE))
        return ex.gaussian_kernel_matvec, args, "64MiB"
    if name in ("attention", "attention_grad"):
        from examples import attention as ex

        q, k, v = (jax.numpy.asarray(a) for a in ex.make_inputs(8, 2048, 64))
        base = ex.attention if name == "attention" else ex.attention_value_and_grad
        return functools.partial(base, causal=False), (q, k, v), "256MiB"
    if name == "train_step":
        from benchmarks.train_step import _setup

        _, loss, params, ids = _setup(1, 512)
        grad = jax.value_and_grad(loss)
        fixed, temps = _fixed_and_temps(grad, (params, ids))
        return grad, (params, ids), int(fixed + 0.5 * temps)
    if name == "conv_step":
        from benchmarks import conv_image as ci

        args = ci.inputs(256)
        grad = jax.grad(ci.loss)
        return grad, args, sum(_fixed_and_temps(grad, args)) // 3
    raise ValueError(f"unknown program {name!r}; expected one of {', '.join(PROGRAMS)}")


def worker(name: str) -> dict[str, Any]:
    """One process: plan and first call, then :data:`REPEATS` timed calls."""
    import jax

    import memsafe

    fun, args, limit = _program(name)
    safe = memsafe.jit(fun, memory_limit=limit)
    start = time.perf_counter()
    jax.block_until_ready(safe(*args))
    first = time.perf_counter() - start
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        jax.block_until_ready(safe(*args))
        times.append(time.perf_counter() - start)
    plan = safe.plan(*args)
    return {
        "first_s": first,
        "step_s": statistics.median(times),
        "footprint": plan.after.total,
        "splits": [s.describe() for s in plan.splits],
    }


def _run(checkout: Path, name: str) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": f"{checkout / 'src'}{os.pathsep}{ROOT}"}
    env.setdefault("JAX_PLATFORMS", "cpu")
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.paired", "--worker", name],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        check=False,
    )
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{name} under {checkout}: {done.stderr.strip()[-2000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": wall}


def _pairs(before: Path, after: Path, name: str, pairs: int) -> dict[str, Any]:
    _run(before, name), _run(after, name)  # warm-ups: file caches, not counted
    rows = []
    for i in range(pairs):
        order = [("after", after), ("before", before)]
        if i % 2:
            order.reverse()
        got = {side: _run(path, name) for side, path in order}
        rows.append(got)
        print(name, i, json.dumps({s: round(got[s]["wall_s"], 3) for s in got}), flush=True)

    def ratio(key: str) -> list[float]:
        return [r["after"][key] / r["before"][key] for r in rows]

    return {
        "pairs": rows,
        "median_ratio": {k: statistics.median(ratio(k)) for k in ("wall_s", "first_s", "step_s")},
        "range_ratio": {k: (min(ratio(k)), max(ratio(k))) for k in ("wall_s", "first_s", "step_s")},
        "same_footprint": all(r["after"]["footprint"] == r["before"]["footprint"] for r in rows),
        "same_splits": all(r["after"]["splits"] == r["before"]["splits"] for r in rows),
    }


def _git(checkout: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    return done.stdout.strip() or str(checkout)


def render(data: dict[str, Any]) -> str:
    lines = [
        f"# memsafe {data['after']} against {data['before']}: paired whole-process runs",
        "",
        f"jax {data['jax']}, {data['cpus']} CPUs, {data['pairs']} pairs per program after one "
        f"warm-up of each, the order alternating; load average {data['load_start']} at the "
        f"start, {data['load_end']} at the end. Ratios after / before, median over the pairs "
        "(min - max). Generated by `python -m benchmarks.paired`.",
        "",
        "| program | process wall | plan + first call | steady call | steady s (before, after) "
        "| same footprint, splits |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in data["programs"].items():
        med, rng = r["median_ratio"], r["range_ratio"]
        steady = [
            statistics.median(p[s]["step_s"] for p in r["pairs"]) for s in ("before", "after")
        ]
        cells = [f"{med[k]:.3f} ({rng[k][0]:.3f} - {rng[k][1]:.3f})" for k in med]
        lines.append(
            f"| {name} | {' | '.join(cells)} | {steady[0]:.3f}, {steady[1]:.3f} | "
            f"{r['same_footprint']}, {r['same_splits']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", metavar="PROGRAM")
    parser.add_argument("--before", type=Path)
    parser.add_argument("--after", type=Path)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--programs", default=",".join(PROGRAMS))
    parser.add_argument("--out", default="paired")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    if args.before is None or args.after is None:
        parser.error("--before and --after name the two checkouts")
    import jax

    data: dict[str, Any] = {
        "before": _git(args.before),
        "after": _git(args.after),
        "pairs": args.pairs,
        "jax": jax.__version__,
        "cpus": os.cpu_count(),
        "load_start": [round(x, 2) for x in os.getloadavg()],
        "programs": {},
    }
    for name in args.programs.split(","):
        data["programs"][name] = _pairs(args.before, args.after, name, args.pairs)
        data["load_end"] = [round(x, 2) for x in os.getloadavg()]
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / f"{args.out}.json").write_text(json.dumps(data, indent=1))
        (RESULTS / f"{args.out}.md").write_text(render(data))


if __name__ == "__main__":
    main()
