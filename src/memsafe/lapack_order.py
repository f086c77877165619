"""LAPACK order: on jaxlib 0.10's CPU backend, batched LAPACK calls run one after another.

jaxlib 0.10's CPU kernels for ``cholesky``, ``triangular_solve``, ``lu``, ``eigh`` and the other
LAPACK calls cut a batch into pieces, schedule them on XLA's intra-op thread pool and wait for them
on a thread of that same pool. XLA runs independent operations at once, so two batched calls with
no data between them can hold every thread of a small pool (two on a 2-core machine) while their
pieces wait in its queue: the program never returns. Plain ``jax.jit`` hangs so on three
independent ``solve_triangular`` calls at a batch of 20,000 6x6 matrices on two cores, and a split
backward of a batched Cholesky solve (two solves in one loop body) did too.

This module gives every equation that calls LAPACK, itself or inside a call, loop or branch, a data
dependency on the one before it in its jaxpr: it runs under a ``cond`` whose predicate reads the
previous call's result. Both branches are the equation itself, so the values are unchanged (a NaN
only picks the other, identical branch). Loop bodies and branches are ordered the same way inside.
memsafe compiles every program it runs through :func:`ordered` (``memsafe.jit``), the original
one included, where :func:`memsafe._jax.lapack_waits_on_its_pool`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from memsafe._jax import (
    LOOP_BODIES,
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    bind_eqn_with,
    jaxprs_in_params,
    lapack_waits_on_its_pool,
    make_closed_jaxpr,
    programs,
    runs_primitive,
)
from memsafe.graph.interpret import evaluate, retrace
from memsafe.primitives import LAPACK


def ordered(fun: Callable[..., Any]) -> Callable[..., Any]:
    """``fun`` (of positional arrays, returning a pytree of arrays) with its LAPACK calls
    ordered where this jaxlib needs it (see the module); ``fun`` itself elsewhere, and where
    ``fun`` carries the jaxpr it runs (``memsafe_closed``, :func:`memsafe.compiling.emit`) and
    that calls no LAPACK."""
    if not lapack_waits_on_its_pool():
        return fun
    known = getattr(fun, "memsafe_closed", None)  # a program memsafe emitted: its jaxpr
    if known is not None and not calls_lapack(known.jaxpr):
        return fun  # (without tracing it once more to find out)

    @functools.wraps(fun)
    def run(*args: Any) -> Any:
        closed, out_tree = make_closed_jaxpr(fun, args)
        if not calls_lapack(closed.jaxpr):
            return fun(*args)
        return jax.tree_util.tree_unflatten(out_tree, evaluate(order(closed), args))

    return run


def calls_lapack(jaxpr: Jaxpr) -> bool:
    """Whether ``jaxpr`` or a jaxpr inside one of its equations calls LAPACK."""
    return runs_primitive(jaxpr, LAPACK)


def _eqn_calls_lapack(eqn: JaxprEqn) -> bool:
    return eqn.primitive.name in LAPACK or any(calls_lapack(j) for j in jaxprs_in_params(eqn))


def order(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with each LAPACK-calling equation made to wait for the previous one."""
    last: list[Any] = []  # an output of the latest LAPACK-calling equation

    def override(_: int, eqn: JaxprEqn, invals: list[Any]) -> Sequence[Any] | None:
        if not _eqn_calls_lapack(eqn):
            return None
        call = functools.partial(_bind_ordered, eqn)
        outs = call(*invals) if not last else lax.cond(_ready(last[0]), call, call, *invals)
        last[:] = [o for o in outs if _readable(o)][:1] or last
        return outs

    return retrace(closed, override)


def _readable(x: Any) -> bool:
    return jnp.size(x) > 0 and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)


def _ready(x: Any) -> Any:
    """A predicate XLA cannot know before ``x`` is computed (true unless ``x``'s first is NaN)."""
    first = jnp.ravel(x)[0]
    return first == first


def _bind_ordered(eqn: JaxprEqn, *invals: Any) -> list[Any]:
    """``eqn`` applied to ``invals``, its loop body or branches ordered too."""
    key = LOOP_BODIES.get(eqn.primitive.name)
    if key is None or not any(calls_lapack(p.jaxpr) for p in programs(eqn)):
        return bind_eqn_with(eqn, invals)
    inner = tuple(order(p) for p in programs(eqn))
    held = inner if isinstance(eqn.params[key], tuple) else inner[0]
    return bind_eqn_with(eqn, invals, **{key: held})
