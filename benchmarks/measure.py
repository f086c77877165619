"""Measurement helpers shared by the workloads: timing, memory, compiled footprints.

Each benchmark case runs in a fresh subprocess (``benchmarks.case``), so peak RSS is the case's
own. Footprints come from XLA's ``memory_analysis()`` (arguments + outputs + temps - aliases +
generated code), the same accounting memsafe verifies against.
"""

from __future__ import annotations

import os
import resource
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax

from memsafe.tuning import SCHEDULE

#: Above this compiled footprint, plain jax.jit is not run: only the bytes it needs are recorded.
DEFAULT_JAX_CAP = 6 * 2**30


def peak_rss() -> int:
    """The process's peak resident set size so far, bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """The process's resident set size now, bytes."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def device_peak() -> int | None:
    """Peak bytes in use on the default device so far (a GPU's allocator reports it; the CPU's
    does not: None there, where peak RSS is the measure)."""
    if jax.default_backend() == "cpu":
        return None
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def on_device(*arrays: Any) -> tuple[Any, ...]:
    """The inputs placed on the default device once, off the CPU: timed calls then do not copy
    them from the host each time (on the CPU, NumPy inputs are passed as the user passes them)."""
    if jax.default_backend() == "cpu":
        return arrays
    return tuple(jax.device_put(a) for a in arrays)


def block(x: Any) -> Any:
    """Wait for JAX arrays in ``x`` (NumPy results pass through)."""
    return jax.block_until_ready(x)


#: Calls before the timed ones: a memsafe program times compile options over its first calls
#: and keeps the faster from then on (memsafe.tuning); every method gets the same.
WARM_UP_CALLS = len(SCHEDULE)


def timed(fn: Callable[[], Any], repeats: int, budget_s: float) -> tuple[Any, dict]:
    """Call ``fn`` :data:`WARM_UP_CALLS` times (compilation, caches, memsafe's trial of compile
    options), then up to ``repeats`` more times while the repeats so far plus one more fit in
    ``budget_s``; at least one repeat is made unless ``repeats`` is 0 (then the single call's
    time, compilation included, is reported). Returns the last result and {first_s (the first
    call's time), times_s, min_s, median_s}."""
    start = time.perf_counter()
    out = block(fn())
    first = time.perf_counter() - start
    if repeats <= 0:  # one call only (long cases): its time includes compilation
        return out, {
            "first_s": first,
            "times_s": [first],
            "min_s": first,
            "median_s": first,
            "includes_compile": True,
        }
    for _ in range(WARM_UP_CALLS - 1):
        out = block(fn())
    times: list[float] = []
    while len(times) < max(1, repeats):
        expected = times[-1] if times else first
        if times and sum(times) + expected > budget_s:
            break
        start = time.perf_counter()
        out = block(fn())
        times.append(time.perf_counter() - start)
    return out, {
        "first_s": first,
        "times_s": times,
        "min_s": min(times),
        "median_s": statistics.median(times),
    }


def footprint_dict(compiled: Any) -> dict[str, int]:
    """``memory_analysis()`` of a compiled program, with the total memsafe bounds."""
    stats = compiled.memory_analysis()
    out = {
        "arguments": int(stats.argument_size_in_bytes),
        "outputs": int(stats.output_size_in_bytes),
        "temps": int(stats.temp_size_in_bytes),
        "aliases": int(stats.alias_size_in_bytes),
        "generated_code": int(stats.generated_code_size_in_bytes),
    }
    out["total"] = (
        out["arguments"] + out["outputs"] + out["temps"] - out["aliases"] + out["generated_code"]
    )
    return out


def environment() -> dict[str, Any]:
    """Where the numbers were taken: backend, device, CPU count, load."""
    dev = jax.devices()[0]
    return {
        "backend": jax.default_backend(),
        "device": getattr(dev, "device_kind", str(dev)),
        "cpu_count": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "jax": jax.__version__,
    }


def _footprint_from(fp: Any) -> dict[str, int]:
    """A memsafe ``Footprint`` as the same dict ``footprint_dict`` gives."""
    return {
        "arguments": fp.arguments,
        "outputs": fp.outputs,
        "temps": fp.temps,
        "aliases": fp.aliases,
        "generated_code": fp.constants,
        "total": fp.total,
    }


def run_jax(
    fun: Callable[..., Any],
    args: tuple,
    params: dict,
    ynn: bool = True,
) -> tuple[Any, dict]:
    """Plain ``jax.jit(fun)`` (YNNPACK fusions on, JAX's default, unless ``ynn`` is False): its
    footprint, and its times when the footprint is under ``params['jax_cap']``; else the bytes it
    would need and no result (status 'does_not_fit')."""
    kwargs = {} if ynn else {"compiler_options": {"xla_cpu_experimental_ynn_fusion_type": ""}}
    start = time.perf_counter()
    compiled = jax.jit(fun, **kwargs).lower(*args).compile()
    info: dict[str, Any] = {"compile_s": time.perf_counter() - start}
    info["footprint"] = footprint_dict(compiled)
    if ynn and jax.default_backend() == "cpu":
        # YNNPACK fusions hold buffers memory_analysis() does not count: the footprint with
        # them off is the accounted one (memsafe's), and decides whether jax.jit is run.
        off = {"compiler_options": {"xla_cpu_experimental_ynn_fusion_type": ""}}
        info["footprint_ynn_off"] = footprint_dict(jax.jit(fun, **off).lower(*args).compile())
    need = max(info["footprint"]["total"], info.get("footprint_ynn_off", {}).get("total", 0))
    info["need_bytes"] = need
    cap = int(params.get("jax_cap", DEFAULT_JAX_CAP))
    if need > cap:
        info.update(status="does_not_fit", cap=cap)
        return None, info
    rss0 = current_rss()
    out, times = timed(lambda: compiled(*args), params["repeats"], params["budget_s"])
    info.update(times, rss_growth_bytes=peak_rss() - rss0)
    return out, info


def run_memsafe(fun: Callable[..., Any], args: tuple, params: dict) -> tuple[Any, dict]:
    """``memsafe.jit(fun, memory_limit=params['limit'])``: build (rewrite + verify) time, the
    verified footprint, what the plan did, and run times."""
    import memsafe

    safe = memsafe.jit(fun, memory_limit=params["limit"])
    start = time.perf_counter()
    plan = safe.plan(*args)
    info: dict[str, Any] = {"build_s": time.perf_counter() - start, "limit": safe.memory_limit}
    info["footprint"] = _footprint_from(plan.after)
    info["footprint_before"] = _footprint_from(plan.before)
    info["plan"] = {
        "fits_unchanged": plan.fits_unchanged,
        "attempts": len(plan.attempts),
        "rules": [r.describe() for r in plan.rules],
        "splits": [s.describe() for s in plan.splits],
    }
    rss0 = current_rss()
    out, times = timed(lambda: safe(*args), params["repeats"], params["budget_s"])
    info.update(times, rss_growth_bytes=peak_rss() - rss0)
    # the executable that ran after memsafe's trial of compile options (memsafe.tuning)
    info.update(footprint=_footprint_from(plan.after), tuning=plan.tuning)
    return out, info


def run_plain(fn: Callable[[], Any], params: dict) -> tuple[Any, dict]:
    """A peer that is not a JAX program (faiss, KeOps): times and RSS growth."""
    rss0 = current_rss()
    out, times = timed(fn, params["repeats"], params["budget_s"])
    return out, {**times, "rss_growth_bytes": peak_rss() - rss0}


def square_cases(sizes: tuple[int, ...], limit: str, methods: tuple[str, ...]) -> list[dict]:
    """Cases with n = m points in 3 dimensions for each of ``sizes``, under ``limit``."""
    return [
        {"label": f"n=m={n}", "n": n, "m": n, "d": 3, "limit": limit, "methods": list(methods)}
        for n in sizes
    ]
