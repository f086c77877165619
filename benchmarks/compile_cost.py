"""Compile and dispatch cost of memsafe.jit against jax.jit (issue 14, item 2).

For each quick program (attention at L=4096 under 64 MiB, kNN, Gaussian kernel matvec, SGPR), in
a fresh process per repeat (so that the first call pays everything a user's first call pays):

- ``jax_first_s``: jax.jit's first call (trace, compile, one run), after a trivial jit call has
  started the backend; ``jax_run_s``: its later calls (median of three);
- ``memsafe_first_s``: memsafe.jit's first call (plan, compile attempts, one run) and its
  ``attempts``; ``trial_s``: its calls 2-6 together (where memsafe times compile options,
  memsafe.tuning); ``memsafe_run_s``: later calls;
- ``second_wrapper_s``: the first call of a second ``memsafe.jit(f, ...)`` of the same function
  and limit; ``second_plan_s``: the planning alone (``.plan`` of a third wrapper);
- ``xla_compiles``: XLA compiles (JAX's backend-compile events) during memsafe's first call;
- ``dispatch_us``: per-call time of a compiled program on small inputs (it fits unchanged), for
  jax.jit and memsafe, median over repeats of the mean of many calls.

Each number is the median over the processes. ``python -m benchmarks.compile_cost --label after``
writes ``results/compile-cost.json`` (labels kept side by side) and ``results/compile-cost.md``.
"""

from __future__ import annotations

import argparse
import functools
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
WORKLOADS = ("attention", "knn", "kernel_matvec", "sgpr")


def _attention(small: bool) -> tuple[Callable, tuple, str]:
    from examples import attention as ex

    shape = (1, 8, 4) if small else (8, 4096, 64)
    return functools.partial(ex.attention, causal=False), ex.make_inputs(*shape), "64MiB"


def _knn(small: bool) -> tuple[Callable, tuple, str]:
    from examples import knn as ex

    shape = (8, 32, 4) if small else (1000, 100_000, 64)
    return functools.partial(ex.knn_l2_expanded, k=10), ex.make_inputs(*shape), "64MiB"


def _kernel_matvec(small: bool) -> tuple[Callable, tuple, str]:
    import numpy as np

    from examples import kernel_matvec as ex

    n = 32 if small else 20_000
    x, y, v = ex.make_inputs(n, n, 3)
    return ex.gaussian_kernel_matvec, (x, y, v, np.float32(0.5)), "64MiB"


def _sgpr(small: bool) -> tuple[Callable, tuple, str]:
    import jax

    jax.config.update("jax_enable_x64", True)
    from benchmarks.sgpr import _inputs
    from examples import sgpr as ex

    n, m = (32, 4) if small else (50_000, 500)
    data = _inputs({"n": n, "m": m, "d": 3})
    theta = {k: data[k] for k in ("variance", "lengthscales", "noise", "Z")}
    return ex.sgpr_elbo, (theta, data["x"], data["y"]), "128MiB"


PROGRAMS = {
    "attention": _attention,
    "knn": _knn,
    "kernel_matvec": _kernel_matvec,
    "sgpr": _sgpr,
}
DESCRIPTIONS = {
    "attention": "attention 8 x 4096 x 64, 64 MiB",
    "knn": "kNN L2 1k x 100k x 64, k=10, 64 MiB",
    "kernel_matvec": "kernel matvec n=m=20k, d=3, 64 MiB",
    "sgpr": "SGPR bound N=50k, M=500 (float64), 128 MiB",
}


def _first_call(fun: Callable[..., Any], args: tuple) -> float:
    import jax

    start = time.perf_counter()
    jax.block_until_ready(fun(*args))
    return time.perf_counter() - start


def _median_run(fun: Callable[..., Any], args: tuple, repeats: int = 3) -> float:
    return statistics.median(_first_call(fun, args) for _ in range(repeats))


def _per_call_us(fun: Callable[..., Any], args: tuple, round_s: float = 0.2) -> float:
    """Median over 7 rounds of the mean time of a round's calls (about ``round_s`` seconds of
    them; results waited for at the end of a round only, as dispatch is measured), in
    microseconds."""
    import jax

    jax.block_until_ready(fun(*args))
    calls = max(10, int(round_s / max(_first_call(fun, args), 1e-6)))
    rounds = []
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            out = fun(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


class _CompileCounter:
    """Counts JAX's backend-compile events (one per XLA compile request)."""

    def __init__(self) -> None:
        import jax

        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, _duration: float, **_: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


def worker(name: str) -> dict[str, Any]:
    """One process's measurements of one workload (see the module docstring)."""
    import jax
    import jax.numpy as jnp

    import memsafe
    from memsafe.tuning import SCHEDULE

    jax.block_until_ready(jax.jit(lambda x: x + 1)(1.0))  # the backend started
    fun, args, limit = PROGRAMS[name](small=False)
    out: dict[str, Any] = {"jax_first_s": _first_call(jax.jit(fun), args)}
    out["jax_run_s"] = _median_run(jax.jit(fun), args)
    counter = _CompileCounter()
    safe = memsafe.jit(fun, memory_limit=limit)
    out["memsafe_first_s"] = _first_call(safe, args)
    out["xla_compiles"] = counter.count
    plan = safe.plan(*args)
    out["attempts"] = len(plan.attempts)
    out["fits_unchanged"] = plan.fits_unchanged
    start = time.perf_counter()
    out["trial_calls"] = len(SCHEDULE)
    for _ in range(len(SCHEDULE) - 1):  # calls 2 on: memsafe's trial of compile options
        _first_call(safe, args)
    out["trial_s"] = time.perf_counter() - start
    out["tuning"] = plan.tuning
    out["memsafe_run_s"] = _median_run(safe, args)
    out["second_wrapper_s"] = _first_call(memsafe.jit(fun, memory_limit=limit), args)
    start = time.perf_counter()
    memsafe.jit(fun, memory_limit=limit).plan(*args)
    out["second_plan_s"] = time.perf_counter() - start
    small_fun, small_args, _ = PROGRAMS[name](small=True)
    small_args = jax.tree_util.tree_map(jnp.asarray, small_args)
    out["dispatch_jax_us"] = _per_call_us(jax.jit(small_fun), small_args)
    out["dispatch_memsafe_us"] = _per_call_us(
        memsafe.jit(small_fun, memory_limit=limit), small_args
    )
    out["loadavg"] = os.getloadavg()
    return out


def _run_worker(name: str) -> dict[str, Any]:
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    cmd = [sys.executable, "-m", "benchmarks.compile_cost", "--worker", name]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{name} worker failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(names: list[str], repeats: int) -> dict[str, Any]:
    """Median over ``repeats`` fresh processes of each workload's measurements."""
    import jax

    results: dict[str, Any] = {}
    for name in names:
        runs = [_run_worker(name) for _ in range(repeats)]
        keys = [k for k, v in runs[0].items() if isinstance(v, int | float) and k != "loadavg"]
        summary = {k: statistics.median(r[k] for r in runs) for k in keys}
        summary["fits_unchanged"] = runs[0]["fits_unchanged"]
        summary["loadavg"] = [r["loadavg"] for r in runs]
        summary["runs"] = runs
        results[name] = summary
        print(name, json.dumps({k: summary[k] for k in keys}), flush=True)
    return {
        "results": results,
        "repeats": repeats,
        "loadavg_end": os.getloadavg(),
        "cpu_count": os.cpu_count(),
        "jax": jax.__version__,
    }


def _trial(r: dict[str, Any]) -> str:
    """What the trial's calls took together, where the run measured them (memsafe.tuning)."""
    return f" (calls 2-{r.get('trial_calls', 4)}: {r['trial_s']:.2f} s)" if "trial_s" in r else ""


def _table(label: str, run: dict[str, Any]) -> list[str]:
    lines = [
        f"### {label} (jax {run['jax']}, {run['cpu_count']} CPUs, median of "
        f"{run['repeats']} processes, load average at the end "
        f"{', '.join(f'{x:.2f}' for x in run['loadavg_end'])})",
        "",
        "| program | jax.jit first call | memsafe first call | ratio | attempts | XLA compiles "
        "| second wrapper: call (plan) | jax.jit run | memsafe run | dispatch jax.jit "
        "| dispatch memsafe | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in run["results"].items():
        lines.append(
            f"| {DESCRIPTIONS[name]} | {r['jax_first_s']:.2f} s | {r['memsafe_first_s']:.2f} s "
            f"| {r['memsafe_first_s'] / r['jax_first_s']:.1f}x | {r['attempts']:g} "
            f"| {r['xla_compiles']:g} | {r['second_wrapper_s']:.2f} s ({r['second_plan_s']:.3f} s) "
            f"| {r['jax_run_s']:.2f} s "
            f"| {r['memsafe_run_s']:.2f} s{_trial(r)} | {r['dispatch_jax_us']:.1f} us "
            f"| {r['dispatch_memsafe_us']:.1f} us "
            f"| {r['dispatch_memsafe_us'] / r['dispatch_jax_us']:.2f}x |"
        )
    kept = {
        name: sum("runs with LIBRARY" in x.get("tuning", "") for x in r["runs"])
        for name, r in run["results"].items()
        if any(x.get("tuning") for x in r["runs"])
    }
    if kept:
        parts = ", ".join(f"{name} {n} of {run['repeats']}" for name, n in kept.items())
        lines += ["", f"Processes whose trial kept the YNNPACK dot (memsafe.tuning): {parts}."]
    return lines


NOTE = (
    "XLA compiles counts memsafe's one probe of the CPU options, the original program and each "
    "attempt. A second wrapper's call includes one run of the program; its plan alone (in "
    "brackets) is the trace and the cache lookup. The machine is shared: compare ratios within "
    "one label, taken under the load averages shown."
)


def write(label: str, run: dict[str, Any]) -> None:
    """Merge ``run`` under ``label`` into compile-cost.json and rewrite compile-cost.md."""
    path = RESULTS / "compile-cost.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data[label] = run
    path.write_text(json.dumps(data, indent=1, default=float) + "\n")
    lines = ["# Compile and dispatch cost (issue 14, item 2)", "", *__doc__.split("\n\n")[1:4]]
    lines += [NOTE, ""]
    for name, labelled in data.items():
        lines += [*_table(name, labelled), ""]
    (RESULTS / "compile-cost.md").write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--label", default="current")
    parser.add_argument("--only", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the .json")
    args = parser.parse_args()
    if args.render:
        data = json.loads((RESULTS / "compile-cost.json").read_text())
        return write(*data.popitem()) if data else None
    if args.worker:
        print(json.dumps(worker(args.worker), default=float))
        return
    write(args.label, measure(args.only, args.repeats))


if __name__ == "__main__":
    main()
