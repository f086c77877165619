"""Re-tracing interpreter: evaluate a jaxpr equation by equation, letting a pass replace some
equations with plain JAX code, and trace the result back into a new jaxpr.

This is the mechanism every rewriting pass uses (JAX's "custom interpreter" pattern): a pass never
edits jaxpr objects by hand; it says what to compute instead, and JAX builds the new program.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import jax
import numpy as np

from memsafe import primitives
from memsafe._jax import (
    CUSTOM_DIFF_PRIMITIVES,
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    bind_eqn,
    cond_branches,
    implementation_jaxpr,
    inner_jaxpr,
    is_tracer,
    make_closed_jaxpr,
    platform_index_value,
    runs_primitive,
)

#: An override receives (equation index, equation, input values) and returns the output values,
#: or None to evaluate the equation unchanged.
Override = Callable[[int, JaxprEqn, list[Any]], Sequence[Any] | None]


@dataclass(frozen=True)
class Group:
    """Equations evaluated together by one callable (a split region's loop).

    Attributes:
        eqns: indices of the equations it replaces (none of them is evaluated on its own).
        needs: values it reads.
        gives: values (or private keys) it defines, in the order ``run`` returns them.
        position: where it runs among equations that do not depend on each other: the equation
            index it takes the place of.
        run: the values of ``gives`` from those of ``needs``.
    """

    eqns: frozenset[int]
    needs: tuple[Any, ...]
    gives: tuple[Any, ...]
    position: int
    run: Callable[[list[Any]], list[Any]]


def evaluate(
    closed: ClosedJaxpr,
    args: Sequence[Any],
    override: Override | None = None,
    env: dict[Any, Any] | None = None,
    groups: Sequence[Group] = (),
) -> list[Any]:
    """Evaluate ``closed`` on ``args`` (concrete or traced), applying ``override`` per equation.

    ``env`` may pre-bind variables (used by splitting to substitute chunk values); it is updated
    in place so callers can read intermediate values back. ``groups`` replace sets of equations
    by one callable each; equations and groups then run in a dependency order that keeps program
    order wherever dependencies allow.
    """
    jaxpr = closed.jaxpr
    env = {} if env is None else env

    def read(atom: Any) -> Any:
        return atom.val if isinstance(atom, Literal) else env[atom]

    for var, val in zip(jaxpr.constvars, closed.consts):
        env.setdefault(var, val)
    for var, val in zip(jaxpr.invars, args):
        env.setdefault(var, val)
    for node in _order(jaxpr.eqns, groups):
        if isinstance(node, Group):
            env.update(zip(node.gives, node.run([env[v] for v in node.needs])))
            continue
        index, eqn = node, jaxpr.eqns[node]
        if all(out in env for out in eqn.outvars):
            continue  # pre-bound by the caller
        invals = [read(a) for a in eqn.invars]
        outs = override(index, eqn, invals) if override is not None else None
        if outs is None:
            outs = bind_eqn(eqn, invals)
        for var, val in zip(eqn.outvars, outs):
            env[var] = val
    return [read(a) for a in jaxpr.outvars]


class Values(Protocol):
    """Where :func:`evaluate_eqns` reads an equation's operands and puts its results: a dict by
    variable, or an environment of its own, such as a chunk body's
    (:class:`memsafe.split.loop.ChunkEnv`: region values at chunk shape, the others whole)."""

    def operands(self, i: int, eqn: JaxprEqn) -> list[Any]:
        """The operands of equation ``i`` (``eqn``)."""
        ...

    def define(self, i: int, eqn: JaxprEqn, outs: Sequence[Any]) -> None:
        """Record the results ``outs`` of equation ``i`` (``eqn``)."""
        ...


#: What :func:`evaluate_eqns` evaluates into (and returns): a mapping by variable (a dict, a
#: ``ChainMap`` whose first map takes the results) or :class:`Values`.
Env = TypeVar("Env", MutableMapping[Any, Any], Values)


@dataclass(frozen=True)
class _ByVariable:
    """:class:`Values` in a mapping by variable (literals read by value)."""

    env: MutableMapping[Any, Any]

    def operands(self, i: int, eqn: JaxprEqn) -> list[Any]:
        env = self.env
        return [a.val if isinstance(a, Literal) else env[a] for a in eqn.invars]

    def define(self, i: int, eqn: JaxprEqn, outs: Sequence[Any]) -> None:
        self.env.update(zip(eqn.outvars, outs))


def evaluate_eqns(
    eqns: Sequence[JaxprEqn],
    order: Iterable[int],
    env: Env,
    bind: Callable[[int, JaxprEqn, list[Any]], Sequence[Any]] | None = None,
) -> Env:
    """Evaluate the equations ``eqns[i]`` for ``i`` in ``order`` (a cone of a program: what a
    value needs), reading their operands from ``env`` and writing their results into it.

    Args:
        eqns: a program's equations.
        order: the indices to evaluate, each after those it reads.
        env: values by variable (those the equations read from outside ``order``; literals are
            read by value), a mapping updated in place; or a :class:`Values` of the caller's
            own.
        bind: ``bind(index, eqn, operands)``, the results of an equation (a chunk body re-binds
            the equations its split axis passes through at chunk shape; the results it returns
            are what ``env`` records, none for an equation that defines nothing there, such as
            a sink whose partial the caller keeps); None: the equation as it is.

    Returns:
        ``env``.
    """
    values = _ByVariable(env) if isinstance(env, MutableMapping) else env
    for i in order:
        eqn = eqns[i]
        invals = values.operands(i, eqn)
        values.define(i, eqn, bind_eqn(eqn, invals) if bind is None else bind(i, eqn, invals))
    return env


def _order(eqns: Sequence[JaxprEqn], groups: Sequence[Group]) -> list[int | Group]:
    """Equations (by index) and groups in a dependency order, program order first."""
    if not groups:
        return list(range(len(eqns)))
    grouped = frozenset().union(*(g.eqns for g in groups))
    nodes: list[int | Group] = [i for i in range(len(eqns)) if i not in grouped]
    nodes += list(groups)

    def needs(n: int | Group) -> list[Any]:
        return list(n.needs) if isinstance(n, Group) else list(eqns[n].invars)

    def gives(n: int | Group) -> tuple[Any, ...]:
        return n.gives if isinstance(n, Group) else tuple(eqns[n].outvars)

    def position(k: int) -> int:
        n = nodes[k]
        return n.position if isinstance(n, Group) else n

    producer = {v: k for k, n in enumerate(nodes) for v in gives(n)}
    deps = [{producer[v] for v in needs(n) if _hashable(v) and v in producer} for n in nodes]
    users: list[list[int]] = [[] for _ in nodes]
    for k, d in enumerate(deps):
        for j in d:
            users[j].append(k)
    ready = [(position(k), k) for k, d in enumerate(deps) if not d]
    heapq.heapify(ready)
    order: list[int | Group] = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(nodes[k])
        for u in users[k]:
            deps[u].discard(k)
            if not deps[u]:
                heapq.heappush(ready, (position(u), u))
    if len(order) != len(nodes):
        raise RuntimeError("memsafe: the grouped equations form a dependency cycle")
    return order


def _hashable(atom: Any) -> bool:
    return not isinstance(atom, Literal)


def retrace(
    closed: ClosedJaxpr,
    override: Override | None = None,
    groups: Sequence[Group] = (),
    env: dict[Any, Any] | None = None,
) -> ClosedJaxpr:
    """A new ClosedJaxpr computing ``closed`` with ``override`` applied and ``groups`` in place
    of their equations (see :func:`evaluate`), at the same input avals. ``env``, where given,
    is emptied and then filled with the traced value of every variable (an override reads the
    values an equation does not take as operands from it)."""

    def run(*xs: Any) -> list[Any]:
        if env is not None:
            env.clear()
        return evaluate(closed, xs, override, env, groups)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    new, _ = make_closed_jaxpr(run, avals)
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
        if eqn.primitive.name == "custom_linear_solve" and not keep_custom_derivatives:
            return _linear_solve(eqn, invals, override)
        sub = inner_jaxpr(eqn)
        if sub is None and not keep_custom_derivatives:
            sub = _looping_implementation(eqn)
        if sub is None:
            return None
        return evaluate(sub, invals, override)

    return override


def _looping_implementation(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """A primitive defined outside JAX by JAX code that runs a loop (lineax's ``linear_solve``:
    a conjugate gradient's ``while``), as that code (:func:`memsafe._jax.implementation_jaxpr`):
    like ``custom_linear_solve``, its own rules only tell JAX how to differentiate and batch it,
    and inlined, its loop is a loop of the program, whose invariants (the operator's matrix) can
    move into it. Without a loop (equinox's ``unvmap_any``, a select) it stays one equation."""
    sub = implementation_jaxpr(eqn)
    if sub is None or not runs_primitive(sub, primitives.LOOPS):
        return None
    return sub


def _linear_solve(eqn: JaxprEqn, invals: list[Any], override: Override) -> Sequence[Any]:
    """A ``custom_linear_solve`` (``jax.scipy.sparse.linalg.cg``, ``lax.custom_linear_solve``)
    as its primal: its ``solve`` jaxpr on its constants and right-hand side. Like a custom_vjp,
    it only tells differentiation how to transpose; inlined, the loop it runs (CG's while loop)
    is a loop of the program, whose invariants (the kernel matrix) can move into it."""
    lengths, jaxprs = eqn.params["const_lengths"], eqn.params["jaxprs"]
    start = lengths.matvec + lengths.vecmat
    consts = invals[start : start + lengths.solve]
    b = invals[sum(lengths) :]
    return evaluate(jaxprs.solve, [*consts, *b], override)


def inline_calls(closed: ClosedJaxpr, *, keep_custom_derivatives: bool = False) -> ClosedJaxpr:
    """Inline nested jit, remat and (unless kept) custom_jvp/custom_vjp calls into one jaxpr.

    Without ``keep_custom_derivatives`` only the primal computation is kept: differentiate the
    original function, not this jaxpr. With it, custom differentiation rules stay as calls, so
    the result can be differentiated exactly as the original. Control flow stays as it is, except
    that platform-dependent code (``platform_index`` and the ``cond`` it selects a branch of) is
    resolved for the default backend.
    """
    return retrace(closed, _inliner(keep_custom_derivatives))
