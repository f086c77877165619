"""Elementwise primitives (every one in the primitive table, by its kind), same-width bitcasts."""

from __future__ import annotations

from memsafe._jax import JaxprEqn
from memsafe.primitives import Kind
from memsafe.split.registry import (
    Mapping,
    NoRule,
    RuleContext,
    Side,
    elementwise,
    shape,
    split_rule,
)

elementwise(kind=Kind.ELEMENTWISE)


@split_rule("bitcast_convert_type")
def _bitcast(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """Same-width bitcasts are elementwise; a width change adds or drops a last axis only."""
    rank_in, rank_out = len(shape(eqn.invars[0])), len(shape(eqn.outvars[0]))
    if axis >= min(rank_in, rank_out):
        raise NoRule("the split axis is the bytes axis of a bitcast")
    return Mapping(ins=(axis,), outs=(axis,))


@split_rule("optimization_barrier")
def _barrier(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """A barrier around one value is the identity on each chunk of it (the remat pass hands
    each recomputed residual to the backward behind its own barrier)."""
    if len(eqn.invars) != 1:
        raise NoRule("optimization_barrier around several values")
    return Mapping(ins=(axis,), outs=(axis,))
