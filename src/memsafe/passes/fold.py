"""Fold: small values that depend on no argument are computed while planning, as XLA folds them.

XLA's constant folding evaluates, at compile time and one operation at a time, the parts of
jax.jit's program that read no argument: the cotangent sum ``sum(-ones)`` of a centered loss's
gradient, and its division by the count. A split moves such a part into a loop (it reads the
split axis), where XLA cannot fold it and computes it at run time with its own kernels: there a
division by a constant becomes a multiplication by the reciprocal, fused with what follows (fuzz
seed 11300: ``1 + sum(-ones(8800)) / 8800`` folded is 0, computed in memsafe's loop -6.8e-9, and a
gradient jax.jit returns as exactly zero came out 2.1e-6). This pass evaluates every equation
whose operands are all known (literals, the program's constants, values it evaluated) and that
leads to a small result (``policy.REWRITE.fold_bytes``) reduced from a larger argument-free
value, and puts each such result in the program as a constant. The larger values stay as the
equations that make them (a broadcast the split regenerates per chunk) and are evaluated only to
fold what is computed from them, up to ``policy.REWRITE.fold_work_bytes``; a small value made
from small ones (an ``iota`` of a few positions) stays where XLA makes it, as it would stay out
of a split's loop.

Each equation is evaluated alone, as XLA's folding evaluates it. Equations with effects, with
programs in their parameters (loops, calls, custom derivatives) and with values of extended
dtypes (PRNG keys) are left as they are, and loop bodies are not looked into.
"""

from __future__ import annotations

import math
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
    """``closed`` with its small argument-free values computed from large ones as constants
    (unchanged where there are none)."""
    targets, cone = _targets(closed)
    if not targets:
        return closed
    known = _evaluated(closed, cone)
    folded = {v for v in targets if v in known}
    if not folded:
        return closed

    def override(index: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        if not all(v in folded for v in eqn.outvars):
            return None
        return [known[v] for v in eqn.outvars]

    return retrace(closed, override)


def _targets(closed: ClosedJaxpr) -> tuple[set[Any], list[int]]:
    """The values to fold: small, computed from no argument, and reduced from a larger value
    that was computed from one over ``fold_bytes`` (a sum of a broadcast: a split would compute
    it in a loop; a small value made from small ones, an ``iota`` of a few positions, or a mask
    made elementwise from a large ``iota`` stays where XLA makes it); and the equations that
    compute them, in program order."""
    small = policy.REWRITE.fold_bytes
    consts = [v for v in closed.jaxpr.constvars if _plain(v.aval)]
    free = set(consts)
    from_large = {v for v in consts if nbytes_of_aval(v.aval) > small}
    producer: dict[Any, int] = {}
    targets: set[Any] = set()
    eqns = closed.jaxpr.eqns
    for i, eqn in enumerate(eqns):
        if not _foldable(eqn):
            continue
        ins = [a for a in eqn.invars if not isinstance(a, Literal)]
        if not all(a in free for a in ins):
            continue
        large = [a for a in ins if a in from_large]
        for v in eqn.outvars:
            free.add(v)
            producer[v] = i
            if large or nbytes_of_aval(v.aval) > small:
                from_large.add(v)
            if nbytes_of_aval(v.aval) <= small and any(_size(a) > _size(v) for a in large):
                targets.add(v)
    cone: set[int] = set()
    stack = [producer[v] for v in targets]
    while stack:
        i = stack.pop()
        if i in cone:
            continue
        cone.add(i)
        stack.extend(
            producer[a] for a in eqns[i].invars if not isinstance(a, Literal) and a in producer
        )
    return targets, sorted(cone)


def _evaluated(closed: ClosedJaxpr, cone: list[int]) -> dict[Any, Any]:
    """The values of the equations ``cone`` (argument-free, in program order), each evaluated
    alone; an equation whose operands or results exceed ``fold_work_bytes`` is not evaluated,
    nor is anything computed from it."""
    limit = policy.REWRITE.fold_work_bytes
    known: dict[Any, Any] = dict(zip(closed.jaxpr.constvars, closed.consts))
    for i in cone:
        eqn = closed.jaxpr.eqns[i]
        invals = [a.val if isinstance(a, Literal) else known.get(a, _MISSING) for a in eqn.invars]
        if any(v is _MISSING for v in invals):
            continue
        if any(nbytes_of_aval(v.aval) > limit for v in [*eqn.invars, *eqn.outvars]):
            continue
        with jax.ensure_compile_time_eval():
            outs = bind_eqn(eqn, invals)
        known.update((v, np.asarray(o)) for v, o in zip(eqn.outvars, outs))
    return known


_MISSING = object()


def _foldable(eqn: JaxprEqn) -> bool:
    """An equation this pass may evaluate: no effects, no inner programs, plain dtypes."""
    if eqn.effects or inner_jaxpr(eqn) is not None or not eqn.outvars:
        return False
    return all(_plain(a.aval) for a in [*eqn.invars, *eqn.outvars])


def _size(var: Any) -> int:
    """Elements of a variable's value."""
    return math.prod(var.aval.shape)


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
