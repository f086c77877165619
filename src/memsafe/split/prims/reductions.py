"""Reductions, contractions and top_k: sinks where they consume the axis, mappings elsewhere."""

from __future__ import annotations

from typing import Any

from memsafe._jax import JaxprEqn
from memsafe.primitives import Kind, facts
from memsafe.split import sinks, topk
from memsafe.split.registry import (
    Axis,
    Mapping,
    NoRule,
    RuleContext,
    Side,
    bind_unchanged,
    shape,
    split_rule,
)
from memsafe.split.sinks import Sink


@split_rule(kind=Kind.REDUCTION)
def _reduce(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping | Sink:
    """Every reduction over ``axes`` in the primitive table: a sink of its monoid's reducer
    (``sinks.BY_MONOID``) where the axis is among them."""
    axes = sorted(eqn.params["axes"])
    if side[0] == "in":
        if axis in axes:
            monoid = facts(eqn.primitive.name).monoid
            assert monoid is not None
            return Sink(sinks.BY_MONOID[monoid], ins=(axis,))
        return Mapping(ins=(axis,), outs=(axis - sum(a < axis for a in axes),))
    kept = [d for d in range(len(shape(eqn.invars[0]))) if d not in axes]
    return Mapping(ins=(kept[axis],), outs=(axis,))


@split_rule("dot_general")
def _dot_general(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping | Sink:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lrank, rrank = len(shape(eqn.invars[0])), len(shape(eqn.invars[1]))
    lfree = [d for d in range(lrank) if d not in lc and d not in lb]
    rfree = [d for d in range(rrank) if d not in rc and d not in rb]
    nb = len(lb)
    if side[0] == "out":
        if axis < nb:
            return Mapping(ins=(lb[axis], rb[axis]), outs=(axis,))
        if axis < nb + len(lfree):
            return Mapping(ins=(lfree[axis - nb], None), outs=(axis,))
        return Mapping(ins=(None, rfree[axis - nb - len(lfree)]), outs=(axis,))
    mine, other = (lc, rc) if side[1] == 0 else (rc, lc)
    mine_b, other_b = (lb, rb) if side[1] == 0 else (rb, lb)

    def pair(a: Axis, b: Axis) -> tuple[Axis, Axis]:
        return (a, b) if side[1] == 0 else (b, a)

    if axis in mine:
        return Sink(sinks.DOT, ins=pair(axis, other[list(mine).index(axis)]))
    if axis in mine_b:
        p = list(mine_b).index(axis)
        return Mapping(ins=pair(axis, other_b[p]), outs=(p,))
    if side[1] == 0:
        return Mapping(ins=(axis, None), outs=(nb + lfree.index(axis),))
    return Mapping(ins=(None, axis), outs=(nb + len(lfree) + rfree.index(axis),))


def _rebind_top_k(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    """A chunk of rows: the same top_k, through block maxima where its axis is long."""
    return list(topk.top_k(invals[0], int(eqn.params["k"]), axis=eqn.params.get("axis", -1)))


@split_rule("top_k", rebind=_rebind_top_k, piece_rebind=bind_unchanged)
def _top_k(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping | Sink:
    rank = len(shape(eqn.invars[0]))
    along = eqn.params.get("axis", -1) % rank
    if side[0] == "in" and axis == along:
        return Sink(sinks.TOP_K, ins=(axis,))
    if axis == along:
        raise NoRule("top_k result along its own axis")
    return Mapping(ins=(axis,), outs=(axis, axis))
