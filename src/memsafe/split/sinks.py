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

from memsafe._jax import JaxprEqn, bind_eqn
from memsafe.split import topk
from memsafe.split.axis_rules import Sink

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
    return tuple(bind_eqn(eqn, invals))


def _better(new: Any, best: Any, kind: str) -> Any:
    """Whether ``new`` strictly beats ``best`` (NaN wins once, like jnp.argmax)."""
    beats = new > best if kind == "argmax" else new < best
    if jnp.issubdtype(new.dtype, jnp.inexact):
        beats = beats | (jnp.isnan(new) & ~jnp.isnan(best))
    return beats


def combine(eqn: JaxprEqn, sink: Sink, acc: Partial, new: Partial) -> Partial:
    """Fold a later chunk's partial into the running result."""
    kind = sink.kind
    if kind in ("sum", "dot"):
        return tuple(lax.add(a, b) for a, b in zip(acc, new))
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
