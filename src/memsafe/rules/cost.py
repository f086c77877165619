"""What a rewrite saves, measured by XLA: compiled temporaries and flops of both sides."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from memsafe.xla import memsafe_jit


@functools.lru_cache(maxsize=512)
def _measure(fn: Callable[..., Any], key: tuple) -> tuple[int, float]:
    avals = [jax.ShapeDtypeStruct(shape, np.dtype(dt)) for shape, dt in key]
    compiled = memsafe_jit(fn).lower(*avals).compile()
    stats = compiled.memory_analysis()
    temps = int(stats.temp_size_in_bytes) if stats is not None else 0
    cost = compiled.cost_analysis()
    if isinstance(cost, list | tuple):
        cost = cost[0] if cost else {}
    flops = float((cost or {}).get("flops", 0.0))
    return temps, flops


def measure(fn: Callable[..., Any], avals: Sequence[jax.ShapeDtypeStruct]) -> tuple[int, float]:
    """(temp bytes, flops) of ``fn`` compiled alone at ``avals`` (nothing is allocated)."""
    key = tuple((tuple(a.shape), np.dtype(a.dtype).str) for a in avals)
    return _measure(fn, key)


def savings(
    before: Callable[..., Any], after: Callable[..., Any], avals: Sequence[jax.ShapeDtypeStruct]
) -> tuple[int, float]:
    """(bytes, flops) that ``after`` saves over ``before`` at ``avals``; negative if it costs."""
    tb, fb = measure(before, avals)
    ta, fa = measure(after, avals)
    return tb - ta, fb - fa
