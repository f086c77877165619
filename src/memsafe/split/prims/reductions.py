"""Reductions, contractions and top_k: sinks where they consume the axis, mappings elsewhere."""

from __future__ import annotations

from typing import Any

from memsafe._jax import JaxprEqn
from memsafe.primitives import Kind, contraction_axes, facts
from memsafe.split import sinks, topk
from memsafe.split.registry import (
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
    axes = contraction_axes(eqn)
    if side[0] == "out":
        return Mapping(ins=axes[axis], outs=(axis,))
    (lc, rc), _ = eqn.params["dimension_numbers"]
    mine, other = (lc, rc) if side[1] == 0 else (rc, lc)
    if axis in mine:
        at = (axis, other[list(mine).index(axis)])
        return Sink(sinks.DOT, ins=at if side[1] == 0 else at[::-1])
    out = next(k for k, pair in enumerate(axes) if pair[side[1]] == axis)
    return Mapping(ins=axes[out], outs=(out,))


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
