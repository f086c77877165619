"""``stack``: operands of one shape stacked along a new axis; the split axis passes around it."""

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
