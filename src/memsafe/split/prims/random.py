"""Random bits, generated chunk by chunk (memsafe.split.random_bits). For an array of keys (a
sampler under ``jax.vmap``) the result has the keys' axes first: along one of those, a chunk of
the keys makes its own bits; along the sample's axes, each key's bits are made chunk by chunk."""

from __future__ import annotations

from typing import Any

from memsafe._jax import JaxprEqn, bind_eqn
from memsafe.split import random_bits
from memsafe.split.registry import Mapping, NoRule, RuleContext, Side, split_rule


def _rebind(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int) -> list[Any]:
    if m.ins[0] is not None:  # a chunk of the keys: their bits, whole
        return bind_eqn(eqn, invals)
    keys = len(eqn.invars[0].aval.shape)
    shape, width = tuple(eqn.params["shape"]), int(eqn.params["bit_width"])
    return [random_bits.chunk_bits(invals[0], shape, width, m.outs[0] - keys, start, size)]


@split_rule("random_bits", rebind=_rebind)
def _random_bits(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    why = random_bits.why_not(eqn.invars[0].aval, tuple(eqn.params["shape"]))
    if why is not None:
        raise NoRule(why)
    if axis < len(eqn.invars[0].aval.shape):  # along the keys
        return Mapping(ins=(axis,), outs=(axis,))
    return Mapping(ins=(None,), outs=(axis,))
