"""Linear algebra: batch dimensions, and the independent columns of triangular solves."""

from __future__ import annotations

from memsafe._jax import JaxprEqn
from memsafe.split.registry import Mapping, NoRule, RuleContext, Side, batch_only, shape, split_rule

batch_only("cholesky", "factorizes the matrix")


@split_rule("triangular_solve")
def _triangular_solve(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """``op(a) x = b`` (left side) solves each column of ``b`` on its own, ``x op(a) = b`` each
    row: that axis of ``b`` passes to ``x`` with ``a`` used whole. Batch axes pass through both;
    the triangular system's own axis cannot be split."""
    rank = len(shape(eqn.invars[1]))
    free = rank - 1 if eqn.params["left_side"] else rank - 2
    if axis < rank - 2:
        return Mapping(ins=(axis, axis), outs=(axis,))
    if side != ("in", 0) and axis == free:
        return Mapping(ins=(None, axis), outs=(axis,))
    raise NoRule("triangular_solve along the axis of its triangular system")
