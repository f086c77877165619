"""Random bits, generated chunk by chunk (memsafe.split.random_bits)."""

from __future__ import annotations

from typing import Any

from memsafe._jax import JaxprEqn
from memsafe.split import random_bits
from memsafe.split.registry import Mapping, NoRule, RuleContext, Side, split_rule


def _rebind(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int) -> list[Any]:
    shape, width = tuple(eqn.params["shape"]), int(eqn.params["bit_width"])
    return [random_bits.chunk_bits(invals[0], shape, width, m.outs[0], start, size)]


@split_rule("random_bits", rebind=_rebind)
def _random_bits(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    why = random_bits.why_not(eqn.invars[0].aval, tuple(eqn.params["shape"]))
    if why is not None:
        raise NoRule(why)
    return Mapping(ins=(None,), outs=(axis,))
