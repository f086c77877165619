"""Sinks folded tile by tile inside a kernel, through their reducers' ``partial`` and ``fold``.

A kernel streams the split axis in tiles of one length (a Pallas block has one shape). Where the
axis is not a multiple of it, the last tile is moved back to end at the axis's end: it overlaps
the tile before it, and the positions it shares with earlier tiles must not count twice. For
idempotent monoids (max, min, argmax, argmin, and, or) folding a position twice changes nothing
(ties keep the earlier index, NaN wins once). For sums and contractions the shared positions'
operands are replaced by zeros: ``-0.0`` in the first operand, so that each such term is the exact
additive identity. Other sinks (products, top_k, gathers, scatters) are not fused.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn
from memsafe.split.sinks import Partial, Reducer, Sink, additive_identity

#: Reducers (by name) for which folding a position twice changes nothing.
IDEMPOTENT = frozenset({"max", "min", "argmax", "argmin", "and", "or"})
#: Reducers (by name) that add their operands' terms: shared positions are zeroed.
ADDITIVE = frozenset({"sum", "dot"})


def foldable(reducer: Reducer) -> bool:
    """Whether a kernel folds ``reducer``'s tiles (see the module's docstring)."""
    return reducer.name in IDEMPOTENT or reducer.name in ADDITIVE


def partial(
    eqn: JaxprEqn, sink: Sink, invals: list[Any], start: Any, size: int, fresh: Any
) -> Partial:
    """Sink ``eqn``'s partial on the tile ``[start, start + size)`` of the split axis, where
    ``fresh`` (bool, ``size`` long) marks the positions no earlier tile held.

    Args:
        eqn: the sink's equation.
        sink: its sink (reducer, split axis of each operand).
        invals: its operands on the tile.
        start: where the tile starts along the split axis.
        size: the tile's length along it.
        fresh: which of its positions are new.

    Returns:
        The reducer's partial, positions shared with earlier tiles left out.
    """
    if sink.reducer.name in ADDITIVE:
        invals = _zeroed(invals, sink.ins, fresh)
    return sink.reducer.lift(sink.reducer.partial(eqn, invals, sink.axis, start, size))


def _zeroed(invals: list[Any], ins: tuple[int | None, ...], fresh: Any) -> list[Any]:
    out, first = [], True
    for val, ax in zip(invals, ins):
        if ax is None:
            out.append(val)
            continue
        zero = additive_identity(val.dtype) if first else jnp.zeros((), val.dtype)
        keep = lax.broadcast_in_dim(fresh, val.shape, (ax,))
        out.append(lax.select(keep, val, jnp.broadcast_to(zero, val.shape)))
        first = False
    return out
