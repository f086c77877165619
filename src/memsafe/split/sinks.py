"""How each sink combines its results across chunks (the monoid of the reduction).

A sink is an equation that consumes the split axis. Each chunk computes a *partial* result at
chunk shape; partials are folded left to right, so ties keep the earlier (lower) index as
``argmax``/``argmin``/``top_k`` do on the whole axis. No identity elements are needed: the first
chunk's partial is the initial carry.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn, bind_eqn_with
from memsafe.split import topk
from memsafe.split.axis_rules import Sink, chunk_local_indices

Partial = tuple[Any, ...]


def min_chunk(eqn: JaxprEqn, sink: Sink) -> int:
    """Smallest chunk the sink can work with (top_k needs k elements in the first chunk)."""
    return int(eqn.params["k"]) if sink.kind == "top_k" else 1


def partial(eqn: JaxprEqn, invals: list[Any], sink: Sink, start: Any, size: int) -> Partial:
    """The sink's result on one chunk (indices made global by adding ``start``)."""
    axis = sink.ins[0]
    if sink.kind in ("argmax", "argmin"):
        (idx,) = bind_eqn(eqn, invals)
        operand = invals[0]
        val = jnp.take_along_axis(operand, jnp.expand_dims(idx, axis), axis=axis)
        return jnp.squeeze(val, axis), idx + lax.convert_element_type(start, idx.dtype)
    if sink.kind == "top_k":
        k = min(int(eqn.params["k"]), size)
        axis = eqn.params.get("axis", -1)
        vals, idx = topk.top_k(invals[0], k, axis=axis)
        return vals, idx + lax.convert_element_type(start, idx.dtype)
    if sink.kind == "pick":
        return (_pick(eqn, invals, axis, start, size),)
    return tuple(bind_eqn(eqn, invals))


def _pick(eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int) -> Any:
    """A gather indexing the split axis, on one chunk: positions the chunk holds are gathered,
    the rest are the additive identity (-0.0, 0, False), so adding the chunks' partials is exact.
    A position outside the whole axis gets the gather's own out-of-bounds result, from chunk 0."""
    dn = eqn.params["dimension_numbers"]
    operand, indices = invals
    length = eqn.invars[0].aval.shape[axis]
    comp = list(dn.start_index_map).index(axis)
    global_pos, shifted = chunk_local_indices(eqn, indices, comp, axis, start)
    # clipped positions are always held by one chunk: the fill is never kept then
    fill = (
        eqn.params["fill_value"] if eqn.params["mode"] == lax.GatherScatterMode.FILL_OR_DROP else 0
    )
    local = shifted[..., comp]
    held = (local >= 0) & (local < size)
    outside = ((global_pos < 0) | (global_pos >= length)) & (start == 0)
    (out,) = bind_eqn_with(
        eqn, [operand, shifted], mode=lax.GatherScatterMode.FILL_OR_DROP, fill_value=fill
    )
    batch_out = [d for d in range(out.ndim) if d not in dn.offset_dims]
    keep = lax.broadcast_in_dim(held | outside, out.shape, tuple(batch_out))
    return lax.select(keep, out, jnp.full(out.shape, _identity(out.dtype), out.dtype))


def _identity(dtype: Any) -> Any:
    """The exact additive identity: x + (-0.0) == x for every float x, signed zeros included."""
    return -0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0


def _better(new: Any, best: Any, kind: str) -> Any:
    """Whether ``new`` strictly beats ``best`` (NaN wins once, like jnp.argmax)."""
    beats = new > best if kind == "argmax" else new < best
    if jnp.issubdtype(new.dtype, jnp.inexact):
        beats = beats | (jnp.isnan(new) & ~jnp.isnan(best))
    return beats


def combine(eqn: JaxprEqn, sink: Sink, acc: Partial, new: Partial) -> Partial:
    """Fold a later chunk's partial into the running result."""
    kind = sink.kind
    if kind in ("sum", "dot") or (kind == "pick" and acc[0].dtype != jnp.bool_):
        return tuple(lax.add(a, b) for a, b in zip(acc, new))
    if kind == "pick":
        return tuple(lax.bitwise_or(a, b) for a, b in zip(acc, new))
    if kind == "max":
        return tuple(lax.max(a, b) for a, b in zip(acc, new))
    if kind == "min":
        return tuple(lax.min(a, b) for a, b in zip(acc, new))
    if kind == "prod":
        return tuple(lax.mul(a, b) for a, b in zip(acc, new))
    if kind == "and":
        return tuple(lax.bitwise_and(a, b) for a, b in zip(acc, new))
    if kind == "or":
        return tuple(lax.bitwise_or(a, b) for a, b in zip(acc, new))
    if kind in ("argmax", "argmin"):
        (bv, bi), (nv, ni) = acc, new
        take = _better(nv, bv, kind)
        return lax.select(take, nv, bv), lax.select(take, ni, bi)
    if kind == "top_k":
        axis = eqn.params.get("axis", -1) % len(eqn.invars[0].aval.shape)
        vals = lax.concatenate([acc[0], new[0]], axis)
        idx = lax.concatenate([acc[1], new[1]], axis)
        top, pos = lax.top_k(vals, int(eqn.params["k"]), axis=axis)
        return top, jnp.take_along_axis(idx, pos, axis=axis)
    raise ValueError(f"unknown sink kind {kind!r}")


def finish(sink: Sink, acc: Partial) -> list[Any]:
    """The sink equation's results from the folded partials."""
    if sink.kind in ("argmax", "argmin"):
        return [acc[1]]
    return list(acc)
