"""Floating-point work of jaxpr equations, estimated from their shapes (no compile).

The estimate counts what dominates a training step: a contraction costs two flops per
multiply-add, an elementwise operation or a reduction one per element it reads or writes,
layout operations and generators nothing; loops and calls count their bodies (a ``scan`` its
body times its length). It prices recomputation (the staged passes of a split region) for the
plan, where orders of magnitude matter, not exact counts.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from memsafe._jax import JaxprEqn, inner_jaxpr, programs, trip_programs
from memsafe.primitives import Kind, facts


def _size(atom: Any) -> int:
    shape = getattr(getattr(atom, "aval", None), "shape", ())
    return math.prod(shape)


def eqn_flops(eqn: JaxprEqn) -> int:
    """Estimated flops of one equation at the shapes it has in its jaxpr: its table row's rule
    (``memsafe.primitives.Facts.flops``), else its programs' (a loop's body and condition once
    per iteration, ``length`` of them where it says, else one: the trip count of a ``while`` is
    not known from shapes; the dearest branch of a ``cond``; a call's body), else its kind's."""
    name = eqn.primitive.name
    row = facts(name)
    if row.flops is not None:
        return row.flops(eqn)
    if row.control == "loop":
        per_trip = sum(jaxpr_flops(p.jaxpr.eqns) for p in trip_programs(eqn))
        return eqn.params.get("length", 1) * per_trip
    if row.control == "branch":
        return max(jaxpr_flops(p.jaxpr.eqns) for p in programs(eqn))
    inner = inner_jaxpr(eqn)
    if inner is not None:
        return jaxpr_flops(inner.jaxpr.eqns)
    if row.kind in (Kind.LAYOUT, Kind.GENERATOR):
        return 0
    if row.kind in (Kind.REDUCTION, Kind.CUMULATIVE):
        return sum(_size(a) for a in eqn.invars)
    return max((_size(v) for v in eqn.outvars), default=0)


def jaxpr_flops(eqns: Iterable[JaxprEqn]) -> int:
    """Estimated flops of a sequence of equations."""
    return sum(eqn_flops(e) for e in eqns)
