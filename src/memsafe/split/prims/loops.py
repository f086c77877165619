"""Loops: a ``scan`` without a carry (``lax.map``) runs its iterations in chunks."""

from __future__ import annotations

from typing import Any

from memsafe._jax import JaxprEqn, bind_eqn_with
from memsafe.split.registry import Mapping, NoRule, Side, split_rule


def _rebind_map(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """The same loop over the chunk's ``n`` iterations."""
    return bind_eqn_with(eqn, invals, length=n)


@split_rule("scan", rebind=_rebind_map)
def _scan(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    """Iterations of a scan with no carry are independent: the leading axis of every scanned
    input and stacked output is the loop's length and passes; consts are read whole."""
    p = eqn.params
    if p["num_carry"]:
        raise NoRule("scan with a carry: its iterations depend on each other")
    consts = p["num_consts"]
    if axis != 0 or (side[0] == "in" and side[1] < consts):
        raise NoRule("scan: the split axis is inside the loop body")
    xs = len(eqn.invars) - consts
    return Mapping(ins=(None,) * consts + (0,) * xs, outs=(0,) * len(eqn.outvars))
