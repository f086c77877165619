"""Layout primitives that move positions along the split axis (rev, pad, concatenate, offset or
strided slices, dynamic slices and updates): each chunk of the result is read from the whole
operands by index arithmetic.

The operands are used whole, so the axis is *created* here as by a broadcast: an operand that is
a program argument costs nothing, a small computed one is computed before the loop, and a large
one computed chunk by chunk stops the split (its chunks would be needed at other positions).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn, bind_eqn_with
from memsafe.split import sinks
from memsafe.split.registry import (
    AxisMap,
    Mapping,
    NoRule,
    Rebind,
    RuleContext,
    Side,
    bind_unchanged,
    passing,
    split_rule,
    with_size,
)
from memsafe.split.sinks import Sink
from memsafe.split.window import positions, take


def _length(atom: Any, axis: int) -> int:
    return atom.aval.shape[axis]


def _moving(
    name: str,
    moves: Callable[[JaxprEqn, int], bool],
    window: Callable[[JaxprEqn, list, int, Any, int], Any],
    passes: AxisMap,
    rebind_passing: Rebind = bind_unchanged,
) -> None:
    """Register ``name``: where ``moves(eqn, axis)`` the result's chunk is ``window`` of the
    whole operands; elsewhere the axis maps as ``passes`` says, re-bound by ``rebind_passing``
    (positional: a concatenation of channels runs on extended chunks,
    memsafe.split.strategies.halo)."""

    def axis_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping | Sink:
        if not moves(eqn, axis):
            return passes(eqn, side, axis, ctx)
        if side[0] == "in" and _length(eqn.invars[side[1]], axis) != _length(eqn.outvars[0], axis):
            # reached from a chunked operand, the result is of another length: the region
            # stops here and hands the operand on whole (the distribute pass runs what follows
            # a concatenation on its pieces instead)
            raise NoRule(f"{name} changes the length of the split axis")
        return Mapping(ins=tuple(None for _ in eqn.invars), outs=(axis,))

    def rebind(eqn: JaxprEqn, invals: list, m: Mapping, start: Any, n: int) -> list:
        axis = m.outs[0]
        if axis is not None and moves(eqn, axis) and all(a is None for a in m.ins):
            return [window(eqn, invals, axis, start, n)]
        return rebind_passing(eqn, invals, m, start, n)

    def positional(eqn: JaxprEqn, m: Mapping) -> bool:
        return m.outs[0] is not None and not moves(eqn, m.outs[0])

    split_rule(name, rebind=rebind, positional=positional)(axis_map)


# -- rev ----------------------------------------------------------------------------------------


def _rev(eqn: JaxprEqn, invals: list, axis: int, start: Any, n: int) -> Any:
    size = eqn.invars[0].aval.shape[axis]
    pos = size - 1 - positions(start, n)
    (x,) = invals
    others = tuple(d for d in eqn.params["dimensions"] if d != axis)
    x = lax.rev(x, others) if others else x
    return take(x, axis, pos, pos >= 0, 0)


# -- pad ----------------------------------------------------------------------------------------


def _pad(eqn: JaxprEqn, invals: list, axis: int, start: Any, n: int) -> Any:
    x, fill = invals
    lo, _, interior = eqn.params["padding_config"][axis]
    config = list(eqn.params["padding_config"])
    config[axis] = (0, 0, 0)
    x = lax.pad(x, fill, config)  # the other axes padded as the equation does
    q = positions(start, n) - lo
    step = interior + 1
    valid = (q >= 0) & (q % step == 0) & (q // step < x.shape[axis])
    return take(x, axis, q // step, valid, fill)


# -- concatenate ---------------------------------------------------------------------------------


def _concatenate(eqn: JaxprEqn, invals: list, axis: int, start: Any, n: int) -> Any:
    pos = positions(start, n)
    out = None
    offset = 0
    for x in invals:
        size = x.shape[axis]
        here = (pos >= offset) & (pos < offset + size)
        part = take(x, axis, pos - offset, here, 0)
        if out is None:
            out = part
        else:
            keep = lax.broadcast_in_dim(here, part.shape, (axis,))
            out = lax.select(keep, part, out)
        offset += size
    return out


# -- slices -------------------------------------------------------------------------------------


def _slice(eqn: JaxprEqn, invals: list, axis: int, start: Any, n: int) -> Any:
    p = eqn.params
    rank = len(p["start_indices"])
    strides = list(p["strides"] or (1,) * rank)
    starts, limits = list(p["start_indices"]), list(p["limit_indices"])
    pos = starts[axis] + positions(start, n) * strides[axis]
    starts[axis], limits[axis], strides[axis] = 0, invals[0].shape[axis], 1
    x = lax.slice(invals[0], starts, limits, strides)  # the other axes sliced as the eqn does
    return take(x, axis, pos, pos >= 0, 0)


def _dynamic_slice(eqn: JaxprEqn, invals: list, axis: int, start: Any, n: int) -> Any:
    x, *index = invals
    full, size = x.shape[axis], eqn.params["slice_sizes"][axis]
    first = jnp.clip(lax.convert_element_type(index[axis], jnp.int32), 0, full - size)
    sizes = list(eqn.params["slice_sizes"])
    sizes[axis] = full
    index = list(index)
    index[axis] = jnp.zeros_like(index[axis])
    x = lax.dynamic_slice(x, index, sizes)  # the other axes sliced as the eqn does
    pos = first + positions(start, n)
    return take(x, axis, pos, pos >= 0, 0)


def _moves_slice(eqn: JaxprEqn, axis: int) -> bool:
    p = eqn.params
    full = eqn.invars[0].aval.shape[axis]
    stride = 1 if p["strides"] is None else p["strides"][axis]
    return not (p["start_indices"][axis] == 0 and p["limit_indices"][axis] == full and stride == 1)


def _zero_index(invals: list, k: int) -> list:
    """``invals`` with start index ``k`` set to 0 (a full extent along the axis starts at 0)."""
    invals = list(invals)
    invals[k] = lax.full_like(invals[k], 0)
    return invals


def _rebind_dus(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    a = m.ins[0]
    assert a is not None
    return bind_eqn(eqn, _zero_index(invals, 2 + a))


@split_rule("dynamic_update_slice", rebind=_rebind_dus, positional=True)
def _dynamic_update_slice(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    op, upd = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
    if op[axis] != upd[axis]:
        raise NoRule("dynamic_update_slice along the split axis")
    return Mapping(ins=(axis, axis) + (None,) * (len(eqn.invars) - 2), outs=(axis,))


# -- registration ------------------------------------------------------------------------------


def _slice_axis_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping | Sink:
    """A slice keeping the whole axis passes it. One selecting positions along it is, read from
    the operand's chunks, a sink gathering them from the chunks that hold them; producing the
    result's chunks, a window read from the whole operand."""
    if not _moves_slice(eqn, axis):
        return Mapping(ins=(axis,), outs=(axis,))
    if side[0] == "in":
        return Sink(sinks.SLICE, ins=(axis,))
    return Mapping(ins=(None,), outs=(axis,))


def _rebind_slice(eqn: JaxprEqn, invals: list, m: Mapping, start: Any, n: int) -> list:
    axis = m.outs[0]
    assert axis is not None
    if m.ins[0] is None:
        return [_slice(eqn, invals, axis, start, n)]
    limits = with_size(eqn.params["limit_indices"], m.ins[0], n)
    return bind_eqn_with(eqn, invals, limit_indices=limits)


def _pad_passes(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    return Mapping(ins=(axis, None), outs=(axis,))


def _dynamic_slice_passes(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    return Mapping(ins=(axis,) + (None,) * (len(eqn.invars) - 1), outs=(axis,))


def _rebind_dynamic_slice(eqn: JaxprEqn, invals: list, m: Mapping, start: Any, n: int) -> list:
    a = m.ins[0]
    assert a is not None
    sizes = with_size(eqn.params["slice_sizes"], a, n)
    return bind_eqn_with(eqn, _zero_index(invals, 1 + a), slice_sizes=sizes)


def _passing(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    return passing(eqn, axis)


split_rule("slice", rebind=_rebind_slice, positional=lambda e, m: m.ins[0] is not None)(
    _slice_axis_map
)
_moving("rev", lambda e, a: a in tuple(e.params["dimensions"]), _rev, _passing)
_moving("pad", lambda e, a: tuple(e.params["padding_config"][a]) != (0, 0, 0), _pad, _pad_passes)
_moving("concatenate", lambda e, a: a == e.params["dimension"], _concatenate, _passing)
_moving(
    "dynamic_slice",
    lambda e, a: e.params["slice_sizes"][a] != e.invars[0].aval.shape[a],
    _dynamic_slice,
    _dynamic_slice_passes,
    _rebind_dynamic_slice,
)
