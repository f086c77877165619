"""``stack`` and ``unstack``: operands of one shape stacked along a new axis, and a value taken
apart along one; the split axis passes around that axis."""

from __future__ import annotations

from memsafe._jax import JaxprEqn
from memsafe.split.registry import Mapping, NoRule, RuleContext, Side, split_rule


def _around(eqn: JaxprEqn, side: Side, axis: int, stacked: str) -> tuple[int, int]:
    """(axis in the stacked value, axis in the pieces) for the split axis at ``axis`` of
    ``side``, where the ``stacked`` side ("in" or "out") has the extra axis ``params["axis"]``."""
    extra = eqn.params["axis"]
    if side[0] == stacked:
        if axis == extra:
            raise NoRule(f"{eqn.primitive.name} along the split axis")
        piece = axis if axis < extra else axis - 1
    else:
        piece = axis
    return (piece if piece < extra else piece + 1), piece


@split_rule("stack")
def _stack(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    whole, piece = _around(eqn, side, axis, stacked="out")
    return Mapping(ins=tuple(piece for _ in eqn.invars), outs=(whole,))


@split_rule("unstack")
def _unstack(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """``unstack`` (the transpose of ``stack``): results drop the unstacked axis."""
    whole, piece = _around(eqn, side, axis, stacked="in")
    return Mapping(ins=(whole,), outs=tuple(piece for _ in eqn.outvars))
