"""Re-tracing interpreter: evaluate a jaxpr equation by equation, letting a pass replace some
equations with plain JAX code, and trace the result back into a new jaxpr.

This is the mechanism every rewriting pass uses (JAX's "custom interpreter" pattern): a pass never
edits jaxpr objects by hand; it says what to compute instead, and JAX builds the new program.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from memsafe._jax import (
    CUSTOM_DIFF_PRIMITIVES,
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    bind_eqn,
    cond_branches,
    inner_jaxpr,
    is_tracer,
    make_closed_jaxpr,
    platform_index_value,
)

#: An override receives (equation index, equation, input values) and returns the output values,
#: or None to evaluate the equation unchanged.
Override = Callable[[int, JaxprEqn, list[Any]], Sequence[Any] | None]


def evaluate(
    closed: ClosedJaxpr,
    args: Sequence[Any],
    override: Override | None = None,
    env: dict[Any, Any] | None = None,
) -> list[Any]:
    """Evaluate ``closed`` on ``args`` (concrete or traced), applying ``override`` per equation.

    ``env`` may pre-bind variables (used by splitting to substitute chunk values); it is updated
    in place so callers can read intermediate values back.
    """
    jaxpr = closed.jaxpr
    env = {} if env is None else env

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, Literal) else env[atom]

    for var, val in zip(jaxpr.constvars, closed.consts):
        env.setdefault(var, val)
    for var, val in zip(jaxpr.invars, args):
        env.setdefault(var, val)
    for index, eqn in enumerate(jaxpr.eqns):
        if all(out in env for out in eqn.outvars):
            continue  # pre-bound by the caller
        invals = [read(a) for a in eqn.invars]
        outs = override(index, eqn, invals) if override is not None else None
        if outs is None:
            outs = bind_eqn(eqn, invals)
        for var, val in zip(eqn.outvars, outs):
            env[var] = val
    return [read(a) for a in jaxpr.outvars]


def retrace(closed: ClosedJaxpr, override: Override | None = None) -> ClosedJaxpr:
    """A new ClosedJaxpr computing ``closed`` with ``override`` applied, at the same input avals."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    new, _ = make_closed_jaxpr(lambda *xs: evaluate(closed, xs, override), avals)
    return new


def _resolve_platform(eqn: JaxprEqn, invals: list[Any], override: Override) -> Sequence[Any] | None:
    """``platform_index`` becomes the constant it lowers to on this backend, and a ``cond`` on a
    constant index becomes its chosen branch, inlined: ``jnp.diagonal`` and other
    ``lax.platform_dependent`` code then read as plain operations that passes can see through."""
    index = platform_index_value(eqn)
    if index is not None:
        return [np.int32(index)]
    branches = cond_branches(eqn)
    if branches is None or not invals or is_tracer(invals[0]):
        return None
    chosen = min(max(int(invals[0]), 0), len(branches) - 1)  # lax.cond clamps its index
    return evaluate(branches[chosen], invals[1:], override)


def _inliner(keep_custom_derivatives: bool) -> Override:
    def override(index: int, eqn: JaxprEqn, invals: list[Any]) -> Sequence[Any] | None:
        if keep_custom_derivatives and eqn.primitive.name in CUSTOM_DIFF_PRIMITIVES:
            return None
        resolved = _resolve_platform(eqn, invals, override)
        if resolved is not None:
            return resolved
        sub = inner_jaxpr(eqn)
        if sub is None:
            return None
        return evaluate(sub, invals, override)

    return override


def inline_calls(closed: ClosedJaxpr, *, keep_custom_derivatives: bool = False) -> ClosedJaxpr:
    """Inline nested jit, remat and (unless kept) custom_jvp/custom_vjp calls into one jaxpr.

    Without ``keep_custom_derivatives`` only the primal computation is kept: differentiate the
    original function, not this jaxpr. With it, custom differentiation rules stay as calls, so
    the result can be differentiated exactly as the original. Control flow stays as it is, except
    that platform-dependent code (``platform_index`` and the ``cond`` it selects a branch of) is
    resolved for the default backend.
    """
    return retrace(closed, _inliner(keep_custom_derivatives))
