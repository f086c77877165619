"""Fold: small values that depend on no argument are computed while planning, as XLA folds them.

XLA's constant folding evaluates, at compile time and one operation at a time, the parts of
jax.jit's program that read no argument: the cotangent sum ``sum(-ones)`` of a centered loss's
gradient, and its division by the count. A split moves such a part into a loop (it reads the
split axis), where XLA cannot fold it and computes it at run time with its own kernels: there a
division by a constant becomes a multiplication by the reciprocal, fused with what follows (fuzz
seed 11300: ``1 + sum(-ones(8800)) / 8800`` folded is 0, computed in memsafe's loop -6.8e-9, and a
gradient jax.jit returns as exactly zero came out 2.1e-6). This pass evaluates every equation
whose operands are all known (literals, the program's constants, values it evaluated) and puts
each small result (``policy.REWRITE.fold_bytes``) in the program as a constant; larger known
values stay as the equations that make them (a broadcast the split regenerates per chunk) and
are evaluated only to fold what is computed from them, up to ``policy.REWRITE.fold_work_bytes``.

Each equation is evaluated alone, as XLA's folding evaluates it. Equations with effects, with
programs in their parameters (loops, calls, custom derivatives) and with values of extended
dtypes (PRNG keys) are left as they are.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from memsafe import policy
from memsafe._jax import ClosedJaxpr, JaxprEqn, Literal, bind_eqn, inner_jaxpr, nbytes_of_aval
from memsafe.context import PassContext
from memsafe.graph.interpret import retrace

#: Its result does not depend on the attempt (the program alone decides what it folds): run
#: once per search (:class:`memsafe.passes.base.Pass`).
SCALE_FREE = True


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """``closed`` with its small argument-free values as constants (unchanged where none)."""
    known = _known_values(closed)
    folded = {
        var
        for eqn in closed.jaxpr.eqns
        for var in eqn.outvars
        if var in known and nbytes_of_aval(var.aval) <= policy.REWRITE.fold_bytes
    }
    if not folded:
        return closed

    def override(index: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        if not all(v in folded for v in eqn.outvars):
            return None
        return [known[v] for v in eqn.outvars]

    return retrace(closed, override)


def _known_values(closed: ClosedJaxpr) -> dict[Any, Any]:
    """The value of every variable the program computes from no argument, evaluated equation by
    equation (each result at most ``fold_work_bytes``; larger ones are not known)."""
    limit = policy.REWRITE.fold_work_bytes
    known: dict[Any, Any] = {
        v: c
        for v, c in zip(closed.jaxpr.constvars, closed.consts)
        if _plain(v.aval) and nbytes_of_aval(v.aval) <= limit
    }
    for eqn in closed.jaxpr.eqns:
        if not _foldable(eqn, limit):
            continue
        invals = [a.val if isinstance(a, Literal) else known.get(a, _MISSING) for a in eqn.invars]
        if any(v is _MISSING for v in invals):
            continue
        with jax.ensure_compile_time_eval():
            outs = bind_eqn(eqn, invals)
        known.update((v, np.asarray(o)) for v, o in zip(eqn.outvars, outs))
    return known


_MISSING = object()


def _foldable(eqn: JaxprEqn, limit: int) -> bool:
    """An equation this pass may evaluate: no effects, no inner programs, plain dtypes, results
    within ``limit`` bytes each."""
    if eqn.effects or inner_jaxpr(eqn) is not None or not eqn.outvars:
        return False
    atoms = [*eqn.invars, *eqn.outvars]
    if not all(_plain(a.aval) for a in atoms):
        return False
    return all(nbytes_of_aval(v.aval) <= limit for v in eqn.outvars)


def _plain(aval: Any) -> bool:
    """An array of a NumPy dtype (not a PRNG key, a token or another extended type)."""
    dtype = getattr(aval, "dtype", None)
    if dtype is None or not hasattr(aval, "shape"):
        return False
    try:
        np.dtype(dtype)
    except TypeError:
        return False
    return not jax.dtypes.issubdtype(dtype, jax.dtypes.extended)
