"""Layout primitives: broadcasts, reshapes, transposes, slices, pads, concatenations, iota."""

from __future__ import annotations

import math
from typing import Any

from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn, bind_eqn_with
from memsafe.split import sinks
from memsafe.split.registry import Mapping, NoRule, Side, identity_unless, shape, split_rule
from memsafe.split.sinks import Sink


def _with_size(sizes: Any, at: int | None, size: int) -> tuple[int, ...]:
    out = list(sizes)
    assert at is not None
    out[at] = size
    return tuple(out)


def _rebind_broadcast(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    return bind_eqn_with(eqn, invals, shape=_with_size(eqn.params["shape"], m.outs[0], size))


@split_rule("broadcast_in_dim", rebind=_rebind_broadcast)
def _broadcast(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
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
    return bind_eqn_with(
        eqn, invals, new_sizes=_with_size(eqn.params["new_sizes"], m.outs[0], size)
    )


@split_rule("reshape", rebind=_rebind_reshape)
def _reshape(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
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
    there = kept.index(axis) if on_larger else kept[axis]
    big, small = (axis, there) if on_larger else (there, axis)
    return Mapping(ins=(big,), outs=(small,)) if larger == 0 else Mapping((small,), (big,))


@split_rule("squeeze")
def _squeeze(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    return _kept(eqn, side, axis, larger=0)


@split_rule("expand_dims")
def _expand_dims(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    return _kept(eqn, side, axis, larger=1)


@split_rule("transpose")
def _transpose(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    perm = tuple(eqn.params["permutation"])
    if side[0] == "in":
        return Mapping(ins=(axis,), outs=(perm.index(axis),))
    return Mapping(ins=(perm[axis],), outs=(axis,))


def _rebind_iota(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    (out,) = bind_eqn_with(eqn, invals, shape=_with_size(eqn.params["shape"], m.outs[0], size))
    if eqn.params["dimension"] == m.outs[0]:
        out = lax.add(out, lax.convert_element_type(start, out.dtype))
    return [out]


@split_rule("iota", rebind=_rebind_iota)
def _iota(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    return Mapping(ins=tuple(None for _ in eqn.invars), outs=(axis,))


identity_unless(["concatenate"], lambda e: (e.params["dimension"],), "concatenates")
identity_unless(["split"], lambda e: (e.params["axis"],), "splits")
identity_unless(["rev"], lambda e: tuple(e.params["dimensions"]), "reverses")


@split_rule("pad")
def _pad(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    if tuple(eqn.params["padding_config"][axis]) != (0, 0, 0):
        raise NoRule("pad along the split axis")
    return Mapping(ins=(axis, None), outs=(axis,))


def _rebind_slice(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    limits = _with_size(eqn.params["limit_indices"], m.ins[0], size)
    return bind_eqn_with(eqn, invals, limit_indices=limits)


@split_rule("slice", rebind=_rebind_slice)
def _slice(eqn: JaxprEqn, side: Side, axis: int) -> Mapping | Sink:
    """A slice keeping the whole axis passes it; one selecting positions of it (an offset, a
    stride, ``x[:, -1]``) is a sink gathering them from the chunks holding them."""
    full = shape(eqn.invars[0])[axis]
    start, limit = eqn.params["start_indices"][axis], eqn.params["limit_indices"][axis]
    strides = eqn.params["strides"]
    if start == 0 and limit == full and (strides is None or strides[axis] == 1):
        return Mapping(ins=(axis,), outs=(axis,))
    if side[0] == "in":
        return Sink(sinks.SLICE, ins=(axis,))
    raise NoRule("a slice along the split axis cannot produce it in chunks")


def _zero_index(invals: list[Any], k: int) -> list[Any]:
    """``invals`` with start index ``k`` set to 0 (a full extent along the axis starts at 0)."""
    invals = list(invals)
    invals[k] = lax.full_like(invals[k], 0)
    return invals


def _rebind_dynamic_slice(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    a = m.ins[0]
    assert a is not None
    sizes = _with_size(eqn.params["slice_sizes"], a, size)
    return bind_eqn_with(eqn, _zero_index(invals, 1 + a), slice_sizes=sizes)


@split_rule("dynamic_slice", rebind=_rebind_dynamic_slice)
def _dynamic_slice(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    if eqn.params["slice_sizes"][axis] != shape(eqn.invars[0])[axis]:
        raise NoRule("dynamic_slice along the split axis")
    return Mapping(ins=(axis,) + (None,) * (len(eqn.invars) - 1), outs=(axis,))


def _rebind_dus(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    a = m.ins[0]
    assert a is not None
    return bind_eqn(eqn, _zero_index(invals, 2 + a))


@split_rule("dynamic_update_slice", rebind=_rebind_dus)
def _dynamic_update_slice(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    op, upd = shape(eqn.invars[0]), shape(eqn.invars[1])
    if op[axis] != upd[axis]:
        raise NoRule("dynamic_update_slice along the split axis")
    return Mapping(ins=(axis, axis) + (None,) * (len(eqn.invars) - 2), outs=(axis,))
