"""``stack`` and ``unstack``: operands of one shape stacked along a new axis, and a value taken
apart along one; the split axis passes around that axis."""

from __future__ import annotations

from memsafe._jax import JaxprEqn
from memsafe.split.registry import Mapping, NoRule, Side, split_rule


@split_rule("stack")
def _stack(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    new = eqn.params["axis"]
    if side[0] == "out":
        if axis == new:
            raise NoRule("stack along the split axis")
        operand_axis = axis if axis < new else axis - 1
    else:
        operand_axis = axis
    out_axis = operand_axis if operand_axis < new else operand_axis + 1
    return Mapping(ins=tuple(operand_axis for _ in eqn.invars), outs=(out_axis,))


@split_rule("unstack")
def _unstack(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    """``unstack`` (the transpose of ``stack``): results drop the unstacked axis."""
    gone = eqn.params["axis"]
    if side[0] == "in":
        if axis == gone:
            raise NoRule("unstack along the split axis")
        result_axis = axis if axis < gone else axis - 1
    else:
        result_axis = axis
    operand_axis = result_axis if result_axis < gone else result_axis + 1
    return Mapping(ins=(operand_axis,), outs=tuple(result_axis for _ in eqn.outvars))
