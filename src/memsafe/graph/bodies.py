"""The programs an equation runs (a loop's body, a cond's branches, a call's body), walked the same
way by every pass and planner that looks or rewrites inside them.

Custom derivative calls (``custom_jvp_call``, ``custom_vjp_call``) are not walked: their bodies
are inlined before the passes run, except where their rules are kept (the algebraic forward of a
gradient), and a body rewritten there would no longer match its rule.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from memsafe._jax import (
    CALL_PRIMITIVES,
    LOOP_BODIES,
    ClosedJaxpr,
    JaxprEqn,
    bind_eqn_with,
    call_again,
    inner_jaxpr,
    is_var,
    programs,
)
from memsafe.graph.interpret import evaluate


def bodies(eqn: JaxprEqn, calls: bool = True) -> tuple[ClosedJaxpr, ...]:
    """The programs ``eqn`` runs.

    Args:
        eqn: any equation.
        calls: whether a call's body counts (``jit``, ``closed_call``, a chunk body under
            ``jax.checkpoint``: :data:`memsafe._jax.CALL_PRIMITIVES`).

    Returns:
        A loop's body (a ``while``'s, not its condition), a cond's branches, a call's body where
        ``calls``; none for other equations (:data:`memsafe._jax.LOOP_BODIES`).
    """
    if eqn.primitive.name in LOOP_BODIES:
        return programs(eqn)
    sub = inner_jaxpr(eqn) if calls and eqn.primitive.name in CALL_PRIMITIVES else None
    return () if sub is None else (sub,)


def with_bodies(
    eqn: JaxprEqn, invals: list[Any], rewrite: Callable[[ClosedJaxpr], ClosedJaxpr]
) -> list[Any] | None:
    """``eqn`` evaluated with each program it runs (:func:`bodies`) rewritten.

    Args:
        eqn: a loop, cond or call.
        invals: its operands' values.
        rewrite: a program's rewrite, which returns the program itself where it changes nothing.

    Returns:
        The results of a loop or cond bound again with the new programs, or of the new body
        called where the call was (checkpointed like it); None where no program changed.
    """
    old = bodies(eqn)
    new = tuple(rewrite(b) for b in old)
    if all(n is o for n, o in zip(new, old)):
        return None
    name = eqn.primitive.name
    if name not in LOOP_BODIES:
        (body,) = new
        return call_again(eqn, invals, lambda *ops: evaluate(body, list(ops)))
    key = LOOP_BODIES[name]
    return bind_eqn_with(
        eqn, invals, **{key: new if isinstance(eqn.params[key], tuple) else new[0]}
    )


def any_eqn(closed: ClosedJaxpr, pred: Callable[[JaxprEqn], bool]) -> bool:
    """Whether ``closed``, or a loop body or cond branch it runs, has an equation ``pred``
    holds for (calls are not looked into: the passes see programs with calls inlined)."""
    for eqn in closed.jaxpr.eqns:
        if pred(eqn):
            return True
        if any(any_eqn(b, pred) for b in bodies(eqn, calls=False)):
            return True
    return False


def runs_any(closed: ClosedJaxpr, names: Collection[str]) -> bool:
    """Whether ``closed``, or a loop body or cond branch it runs, has an equation of a primitive
    in ``names`` (a pass that rewrites only those can skip the program otherwise)."""
    return any_eqn(closed, lambda eqn: eqn.primitive.name in names)


def inputs_under(jaxpr: Any, values: Collection[Any]) -> set[int]:
    """Positions of the inputs of ``jaxpr`` (a loop's body or predicate) that ``values`` are
    computed from."""
    producer = {o: e for e in jaxpr.eqns for o in e.outvars}
    position = {v: k for k, v in enumerate(jaxpr.invars)}
    found: set[int] = set()
    stack, seen = list(values), set()
    while stack:
        v = stack.pop()
        if not is_var(v) or v in seen:
            continue
        seen.add(v)
        if v in position:
            found.add(position[v])
        elif (e := producer.get(v)) is not None:
            stack.extend(e.invars)
    return found
