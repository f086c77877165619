"""Scans and sorts. A scan along the split axis carries its last value from chunk to chunk
(cumsum, cumprod, cummax, cummin, cumlogsumexp, in order; a reverse scan visits the chunks last
first and carries each chunk's first value); a sort along it cannot be chunked."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn
from memsafe.split.registry import (
    Accumulate,
    Mapping,
    NoRule,
    RuleContext,
    Side,
    identity_unless,
    passing,
    shape,
    split_rule,
)


def _rank(eqn: JaxprEqn) -> int:
    return len(shape(eqn.invars[0]))


def _scan_axis(eqn: JaxprEqn) -> int:
    return eqn.params["axis"] % _rank(eqn)


def _scan(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    dtype = eqn.outvars[0].aval.dtype
    if axis == _scan_axis(eqn) and jnp.issubdtype(dtype, jnp.inexact) and dtype.itemsize < 4:
        # a chunk's scan plus the carry rounds differently from XLA's whole-axis scan in
        # bfloat16/float16, and a top_k after it may then pick a near-tied neighbour (fuzz 448)
        raise NoRule(
            f"{eqn.primitive.name} in {dtype} along the split axis would round differently"
        )
    return passing(eqn, axis)


def _reversed(eqn: JaxprEqn) -> bool:
    return bool(eqn.params["reverse"])


for _name, _combine in {
    "cumsum": lax.add,
    "cumprod": lax.mul,
    "cummax": lax.max,
    "cummin": lax.min,
    "cumlogsumexp": jnp.logaddexp,
}.items():
    split_rule(_name, running=Accumulate(_combine, _scan_axis, _reversed))(_scan)

identity_unless(["sort"], lambda e: (e.params["dimension"] % _rank(e),), "sorts", inherent=True)
