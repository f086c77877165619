"""Floating-point work of jaxpr equations, estimated from their shapes (no compile).

The estimate counts what dominates a training step: a contraction costs two flops per
multiply-add, an elementwise operation or a reduction one per element it reads or writes,
layout operations and generators nothing; loops and calls count their bodies (a ``scan`` its
body times its length). It prices recomputation (the staged passes of a split region) for the
plan, where orders of magnitude matter, not exact counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from memsafe._jax import JaxprEqn, inner_jaxpr
from memsafe.primitives import Kind, facts


def _size(atom: Any) -> int:
    shape = getattr(getattr(atom, "aval", None), "shape", ())
    return math.prod(shape)


def _dot_general(eqn: JaxprEqn) -> int:
    (contract, _), _ = eqn.params["dimension_numbers"]
    lhs = eqn.invars[0].aval.shape
    return 2 * _size(eqn.outvars[0]) * math.prod(lhs[d] for d in contract)


def _conv(eqn: JaxprEqn) -> int:
    """Two flops per output element and kernel tap over one group's input features."""
    kernel = eqn.invars[1].aval.shape
    out_features = kernel[eqn.params["dimension_numbers"].rhs_spec[0]]
    return 2 * _size(eqn.outvars[0]) * math.prod(kernel) // max(1, out_features)


def _scan(eqn: JaxprEqn) -> int:
    return eqn.params["length"] * jaxpr_flops(eqn.params["jaxpr"].jaxpr.eqns)


def _while(eqn: JaxprEqn) -> int:
    """One trip of the body and the condition (the trip count is not known from shapes)."""
    body, cond = eqn.params["body_jaxpr"].jaxpr, eqn.params["cond_jaxpr"].jaxpr
    return jaxpr_flops(body.eqns) + jaxpr_flops(cond.eqns)


def _cond(eqn: JaxprEqn) -> int:
    """The dearest branch."""
    return max(jaxpr_flops(b.jaxpr.eqns) for b in eqn.params["branches"])


#: Primitives priced by their own rule; the rest by their kind (see :func:`eqn_flops`).
RULES: dict[str, Callable[[JaxprEqn], int]] = {
    "dot_general": _dot_general,
    "conv_general_dilated": _conv,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}


def eqn_flops(eqn: JaxprEqn) -> int:
    """Estimated flops of one equation at the shapes it has in its jaxpr."""
    name = eqn.primitive.name
    if name in RULES:
        return RULES[name](eqn)
    inner = inner_jaxpr(eqn)
    if inner is not None:
        return jaxpr_flops(inner.jaxpr.eqns)
    kind = facts(name).kind
    if kind in (Kind.LAYOUT, Kind.GENERATOR):
        return 0
    if kind in (Kind.REDUCTION, Kind.CUMULATIVE):
        return sum(_size(a) for a in eqn.invars)
    return max((_size(v) for v in eqn.outvars), default=0)


def jaxpr_flops(eqns: Iterable[JaxprEqn]) -> int:
    """Estimated flops of a sequence of equations."""
    return sum(eqn_flops(e) for e in eqns)
