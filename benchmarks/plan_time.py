"""Plan time: memsafe's first call against jax.jit's compile, in fresh processes (issue 42).

For each program, in a fresh process per repeat, after a trivial jit call has started the
backend:

- ``jax``: jax.jit's first call for the quick programs (trace, compile, one run), and
  ``jax.jit(f).lower(*args).compile()`` for the training steps (at sizes where jax.jit's
  footprint is over the limit, a run is not what a user could do); its footprint sets the
  steps' limit, arguments + outputs + a quarter of its temporaries (the quick programs keep the
  limits of ``benchmarks.compile_cost``);
- ``memsafe``: the same with ``memsafe.jit(f, memory_limit=limit)``: trace, passes, compile
  attempts, verification (and the run, for the quick ones); its ``plan.time`` by phase is kept;

each **cold** (no cache anywhere) and **warm**: JAX's persistent compilation cache on for both
(``jax_compilation_cache_dir``, every compile cached) and memsafe's plan store on
(``MEMSAFE_CACHE_DIR``), both filled by two earlier processes of each that are not counted
(the first plans and stores the program and its executable, the second loads them).

Programs: the quick ones (attention, kNN, kernel matvec) and four training steps from
``tests/deep_models.py`` (a gradient and Adam's update): the flax transformer with a Python loop
of blocks and with ``nn.scan``, the equinox transformer, and an MLP.

``python -m benchmarks.plan_time [--repeats 3] [--programs a,b]`` writes
``results/plan-time.{json,md}`` with the load average (run it alone on a quiet machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
QUICK = ("attention", "knn", "kernel_matvec")
STEPS = ("flax_loop", "flax_scan", "equinox", "mlp")


def _step(name: str, scale: int = 1) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """A training step of one of ``tests/deep_models.py``'s models and its arguments, at
    ``scale`` times the batch."""
    from tests import deep_models as dm

    shape = dm.Shape(blocks=4, batch=4 * scale, length=1024, width=256)
    if name == "flax_loop":
        model = dm.flax_model(shape)
    elif name == "flax_scan":
        model = dm.flax_model(shape, scan=True)
    elif name == "equinox":
        model = dm.equinox_model(shape)
    else:
        model = dm.mlp(batch=8192 * scale, width=512, layers=8)
    loss, params, batch = model
    step, state = dm.adam_step(loss, params)
    return step, (params, state, *batch)


def _program(name: str) -> tuple[Callable[..., Any], tuple[Any, ...], str | None]:
    """(function, arguments, limit or None: a quarter of jax.jit's temporaries)."""
    if name in QUICK:
        from benchmarks.compile_cost import PROGRAMS

        return PROGRAMS[name](small=False)
    return (*_step(name), None)


def _timed(build: Callable[[], Any]) -> float:
    start = time.perf_counter()
    build()
    return time.perf_counter() - start


def worker(name: str, mode: str, limit: int | None) -> dict[str, Any]:
    """One process: jax.jit's compile (``mode`` "jax"), memsafe's plan ("memsafe"), or a
    training step at twice the batch: jax.jit's compile ("jax2") and memsafe's plan after the
    plan at the first batch ("resize", that first plan not timed)."""
    import jax

    import memsafe

    jax.block_until_ready(jax.jit(lambda x: x + 1)(1.0))  # the backend started
    if mode in ("jax2", "resize"):
        return _resize_worker(name, mode, limit)
    fun, args, quick_limit = _program(name)
    out: dict[str, Any] = {"loadavg": os.getloadavg()}
    quick = quick_limit is not None
    if mode == "jax":
        compiled: list[Any] = []
        if quick:  # the first call (trace, compile, run), before anything else is compiled
            out["seconds"] = _timed(lambda: jax.block_until_ready(jax.jit(fun)(*args)))
        lowered = _timed(lambda: compiled.append(jax.jit(fun).lower(*args).compile()))
        out["seconds"] = out.get("seconds", lowered)
        m = compiled[0].memory_analysis()
        fixed = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
        out["footprint"] = fixed + m.temp_size_in_bytes
        out["limit"] = fixed + m.temp_size_in_bytes // 4
        if quick_limit is not None:
            out["limit"] = memsafe.parse_limit(quick_limit)
        return out
    safe = memsafe.jit(fun, memory_limit=limit)
    if quick:
        out["seconds"] = _timed(lambda: jax.block_until_ready(safe(*args)))
    else:
        out["seconds"] = _timed(lambda: safe.lower(*args).compile())
    plan = safe.plan(*args)
    out["attempts"] = len(plan.attempts)
    out["after"] = plan.after.total
    out["fits_unchanged"] = plan.fits_unchanged
    out["phases"] = plan.time.describe()
    out["origin"] = plan.time.origin
    return out


def _resize_worker(name: str, mode: str, limit: int | None) -> dict[str, Any]:
    import jax

    import memsafe

    fun, args = _step(name, 2)
    out: dict[str, Any] = {"loadavg": os.getloadavg()}
    if mode == "jax2":
        out["seconds"] = _timed(lambda: jax.jit(fun).lower(*args).compile())
        return out
    safe = memsafe.jit(fun, memory_limit=limit)
    safe.lower(*_step(name, 1)[1]).compile()
    out["seconds"] = _timed(lambda: safe.lower(*args).compile())
    plan = safe.plan(*args)
    out["origin"], out["phases"], out["attempts"] = (
        plan.time.origin,
        plan.time.describe(),
        len(plan.attempts),
    )
    return out


def _run(name: str, mode: str, limit: int | None, cache: Path | None) -> dict[str, Any]:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.pop("MEMSAFE_CACHE_DIR", None)
    if cache is not None:
        env["MEMSAFE_CACHE_DIR"] = str(cache / "memsafe")
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache / "jax")
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    cmd = [sys.executable, "-m", "benchmarks.plan_time", "--worker", name, mode, str(limit or 0)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} {mode} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(names: list[str], repeats: int) -> dict[str, Any]:
    """Per program: jax.jit's and memsafe's medians over ``repeats`` fresh processes, cold and
    warm."""
    import jax

    results: dict[str, Any] = {}
    loadavg_start = os.getloadavg()
    for name in names:
        jax_cold = [_run(name, "jax", None, None) for _ in range(repeats)]
        limit = jax_cold[0]["limit"]
        ms_cold = [_run(name, "memsafe", limit, None) for _ in range(repeats)]
        with tempfile.TemporaryDirectory() as tmp:
            cache = Path(tmp)
            for _ in range(2):  # fill both caches (not counted)
                _run(name, "jax", None, cache)
                _run(name, "memsafe", limit, cache)
            jax_warm = [_run(name, "jax", None, cache) for _ in range(repeats)]
            ms_warm = [_run(name, "memsafe", limit, cache) for _ in range(repeats)]

        def med(runs: list[dict[str, Any]]) -> float:
            return statistics.median(r["seconds"] for r in runs)

        resize: dict[str, Any] = {}
        if name in STEPS:  # a new batch size of the step just planned (the same limit)
            jax2 = [_run(name, "jax2", None, None) for _ in range(repeats)]
            ms2 = [_run(name, "resize", limit, None) for _ in range(repeats)]
            resize = {
                "jax_2x_s": med(jax2),
                "memsafe_2x_s": med(ms2),
                "origin_2x": ms2[0]["origin"],
                "phases_2x": ms2[0]["phases"],
                "attempts_2x": ms2[0]["attempts"],
            }

        row = {
            "footprint": jax_cold[0]["footprint"],
            "limit": limit,
            "jax_cold_s": med(jax_cold),
            "memsafe_cold_s": med(ms_cold),
            "jax_warm_s": med(jax_warm),
            "memsafe_warm_s": med(ms_warm),
            "attempts": ms_cold[0]["attempts"],
            "fits_unchanged": ms_cold[0]["fits_unchanged"],
            "after_cold": ms_cold[0]["after"],
            "after_warm": ms_warm[0]["after"],
            "origin_warm": ms_warm[0]["origin"],
            "phases_cold": ms_cold[0]["phases"],
            "phases_warm": ms_warm[0]["phases"],
            "runs": {"jax_cold": jax_cold, "memsafe_cold": ms_cold},
            "runs_warm": {"jax": jax_warm, "memsafe": ms_warm},
            **resize,
        }
        results[name] = row
        print(name, json.dumps({k: v for k, v in row.items() if not k.startswith("runs")}))
    return {
        "results": results,
        "repeats": repeats,
        "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
    }


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def write(run: dict[str, Any]) -> None:
    """``results/plan-time.json`` and ``results/plan-time.md``."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "plan-time.json").write_text(json.dumps(run, indent=1, default=float) + "\n")
    load = ", ".join(f"{x:.2f}" for x in run["loadavg_end"])
    if "loadavg_start" in run:
        start = ", ".join(f"{x:.2f}" for x in run["loadavg_start"])
        load = f"{start} at the start, {load} at the end"
    else:
        load = f"{load} at the end"
    lines = [
        "# Plan time against jax.jit's compile (issue 42)",
        "",
        *__doc__.split("\n\n")[1:4],
        "",
        f"jax {run['jax']}, {run['cpu_count']} CPUs, median of {run['repeats']} fresh processes "
        f"per cell, load average {load}.",
        "",
        "| program | jax.jit footprint | limit | jax.jit cold | memsafe cold | ratio | attempts "
        "| jax.jit warm | memsafe warm | ratio | memsafe warm was | same footprint |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in run["results"].items():
        lines.append(
            f"| {name} | {_mib(r['footprint'])} | {_mib(r['limit'])} | {r['jax_cold_s']:.2f} s "
            f"| {r['memsafe_cold_s']:.2f} s | {r['memsafe_cold_s'] / r['jax_cold_s']:.2f}x "
            f"| {r['attempts']} | {r['jax_warm_s']:.2f} s | {r['memsafe_warm_s']:.2f} s "
            f"| {r['memsafe_warm_s'] / r['jax_warm_s']:.2f}x | {r['origin_warm']} "
            f"| {r['after_cold'] == r['after_warm']} |"
        )
    resized = {n: r for n, r in run["results"].items() if "jax_2x_s" in r}
    if resized:
        lines += [
            "",
            "A training step at twice the batch, planned after the step at the first batch "
            "(the same limit), against jax.jit's compile at that batch:",
            "",
            "| program | jax.jit | memsafe | ratio | memsafe was | attempts |",
            "|---|---|---|---|---|---|",
        ]
        for name, r in resized.items():
            lines.append(
                f"| {name} | {r['jax_2x_s']:.2f} s | {r['memsafe_2x_s']:.2f} s "
                f"| {r['memsafe_2x_s'] / r['jax_2x_s']:.2f}x | {r['origin_2x']} "
                f"| {r['attempts_2x']} |"
            )
    lines += ["", "Where memsafe's time went (the first cold process and the first warm one):", ""]
    for name, r in run["results"].items():
        lines += [f"- {name}: cold {r['phases_cold']}; warm {r['phases_warm']}"]
    (RESULTS / "plan-time.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--programs", default=",".join((*QUICK, *STEPS)))
    parser.add_argument("--worker", nargs=3, metavar=("NAME", "MODE", "LIMIT"))
    args = parser.parse_args(argv)
    if args.worker:
        name, mode, limit = args.worker
        print(json.dumps(worker(name, mode, int(limit) or None), default=float))
        return 0
    names = [n for n in args.programs.split(",") if n]
    unknown = sorted(set(names) - set(QUICK) - set(STEPS))
    if unknown:
        parser.error(f"unknown programs {unknown}; choose from {', '.join((*QUICK, *STEPS))}")
    write(measure(names, args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
