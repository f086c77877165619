"""Layout primitives: broadcasts, reshapes, transposes, slices, pads, concatenations, iota."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn_with
from memsafe.split.registry import (
    Mapping,
    NoRule,
    RuleContext,
    Side,
    identity_unless,
    shape,
    split_rule,
    with_size,
)


def _rebind_broadcast(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    return bind_eqn_with(eqn, invals, shape=with_size(eqn.params["shape"], m.outs[0], size))


@split_rule("broadcast_in_dim", rebind=_rebind_broadcast, positional=True)
def _broadcast(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    if len(eqn.invars) != 1:
        raise NoRule("broadcast_in_dim with dynamic shapes")
    dims = eqn.params["broadcast_dimensions"]
    in_shape = shape(eqn.invars[0])
    if side[0] == "in":
        return Mapping(ins=(axis,), outs=(dims[axis],))
    size = eqn.params["shape"][axis]
    for j, d in enumerate(dims):
        if d == axis and in_shape[j] == size:
            return Mapping(ins=(j,), outs=(axis,))
    return Mapping(ins=(None,), outs=(axis,))  # the axis is created here: regenerate per chunk


def _rebind_reshape(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    return bind_eqn_with(eqn, invals, new_sizes=with_size(eqn.params["new_sizes"], m.outs[0], size))


@split_rule("reshape", rebind=_rebind_reshape, positional=True)
def _reshape(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    if eqn.params.get("dimensions") is not None or len(eqn.invars) != 1:
        raise NoRule("reshape with a dimension permutation or dynamic shape")
    in_shape, out_shape = shape(eqn.invars[0]), shape(eqn.outvars[0])
    src, dst = (in_shape, out_shape) if side[0] == "in" else (out_shape, in_shape)
    before = math.prod(src[:axis])
    for k in range(len(dst)):
        if math.prod(dst[:k]) == before and dst[k] == src[axis]:
            return Mapping(ins=(axis,), outs=(k,)) if side[0] == "in" else Mapping((k,), (axis,))
    raise NoRule(f"reshape {in_shape} -> {out_shape} merges or splits the axis")


def _kept(eqn: JaxprEqn, side: Side, axis: int, larger: int) -> Mapping:
    """The mapping of a primitive dropping (squeeze) or adding (expand_dims) size-1 axes: the
    ``larger`` side (0: operand, 1: result) has the axes ``dimensions`` names."""
    atoms = (eqn.invars[0], eqn.outvars[0])
    rank = len(shape(atoms[larger]))
    dims = {d % rank for d in eqn.params["dimensions"]}
    kept = [d for d in range(rank) if d not in dims]
    on_larger = (side[0] == "in") == (larger == 0)
    if on_larger and axis not in kept:
        raise NoRule(f"{eqn.primitive.name}: the split axis is a size-1 axis it drops or adds")
    there = kept.index(axis) if on_larger else kept[axis]
    big, small = (axis, there) if on_larger else (there, axis)
    return Mapping(ins=(big,), outs=(small,)) if larger == 0 else Mapping((small,), (big,))


@split_rule("squeeze")
def _squeeze(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    return _kept(eqn, side, axis, larger=0)


@split_rule("expand_dims")
def _expand_dims(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    return _kept(eqn, side, axis, larger=1)


@split_rule("transpose")
def _transpose(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    perm = tuple(eqn.params["permutation"])
    if side[0] == "in":
        return Mapping(ins=(axis,), outs=(perm.index(axis),))
    return Mapping(ins=(perm[axis],), outs=(axis,))


def _rebind_iota(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    """The chunk's positions along the split axis: counted in integers from ``start`` and
    converted once, as the whole ``iota`` converts each position (a float ``iota`` counted in
    its own dtype and shifted would round twice: in bfloat16 the chunk's ``26 + 680`` is not
    always the whole one's ``706``, and an ``argmin`` over it picked another position)."""
    shape = with_size(eqn.params["shape"], m.outs[0], size)
    if eqn.params["dimension"] != m.outs[0]:
        return bind_eqn_with(eqn, invals, shape=shape)
    dtype = np.dtype(eqn.params["dtype"])
    count = dtype if np.issubdtype(dtype, np.integer) else np.dtype(np.int32)
    (out,) = bind_eqn_with(eqn, invals, shape=shape, dtype=count)
    out = lax.add(out, lax.convert_element_type(start, count))
    return [lax.convert_element_type(out, dtype)]


@split_rule("iota", rebind=_rebind_iota, positional=True)
def _iota(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    return Mapping(ins=tuple(None for _ in eqn.invars), outs=(axis,))


identity_unless(["split"], lambda e: (e.params["axis"],), "splits")
