"""Scans and sorts: the split axis passes unless they act along it."""

from __future__ import annotations

from memsafe._jax import JaxprEqn
from memsafe.primitives import CUMULATIVE
from memsafe.split.registry import identity_unless, shape


def _rank(eqn: JaxprEqn) -> int:
    return len(shape(eqn.invars[0]))


identity_unless(sorted(CUMULATIVE), lambda e: (e.params["axis"] % _rank(e),), "scans")
identity_unless(["sort"], lambda e: (e.params["dimension"] % _rank(e),), "sorts")
