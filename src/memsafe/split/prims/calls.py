"""Calls and branches. A call whose body maps the split axis through (a ``jax.checkpoint``
region, a nested ``jit``) runs on each chunk: its body re-traced at chunk shape, checkpointed
again where it was. A ``cond`` whose branches all map the split axis the same way runs each
chunk through the branch its (whole, scalar) index picks; a result its branches sum over the axis
into is the sum of the chunks' results.

The pipeline inlines the user's calls before planning, so the calls met here are the ones a
split emitted: every chunk loop checkpoints its chunk body, and a later split along another axis
(rows after columns) passes through the first loop's chunk calls as through its ``scan``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from memsafe._jax import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Literal,
    Var,
    checkpointed_like,
    jaxpr_as_fun,
)
from memsafe.graph.interpret import inline_calls
from memsafe.split import body as loop_body
from memsafe.split.registry import (
    Mapping,
    NoRule,
    RuleContext,
    Running,
    Side,
    Through,
    split_rule,
)

#: Call primitives whose body is the parameter ``jaxpr``.
CALLS = ("remat2", "checkpoint", "pjit", "jit", "closed_call")


@functools.lru_cache(maxsize=64)
def _inlined(sub: Any) -> ClosedJaxpr:
    """A call's body (open or closed) with its own nested calls inlined."""
    closed = sub if isinstance(sub, ClosedJaxpr) else ClosedJaxpr(sub, ())
    return inline_calls(closed)


def _body(eqn: JaxprEqn) -> ClosedJaxpr:
    sub = eqn.params.get("jaxpr")
    if not isinstance(sub, (ClosedJaxpr, Jaxpr)):
        raise NoRule(f"{eqn.primitive.name}: no body to run on a chunk")
    return _inlined(sub)


BodySplit = tuple[ClosedJaxpr, loop_body.Reached]  # a body and its split


def _axes(
    body: ClosedJaxpr, side: Side, axis: int, ctx: RuleContext, same: bool = False
) -> BodySplit:
    """``body`` reached from the axis at ``side``, in ``ctx`` (a body's context); with
    ``same``, results that read nothing of the axis are allowed (a cond's counters)."""
    seeds = {side[1]: axis}
    ins, outs = (seeds, {}) if side[0] == "in" else ({}, seeds)
    return body, loop_body.reach(body.jaxpr, ins, outs, ctx, sums=same)


def _mapping(
    name: str, reached: BodySplit, side: Side, axis: int, ctx: RuleContext, sums: bool = False
) -> Through:
    """Every operand and result of a body (reached in ``ctx``) at the axis its value carries;
    with ``sums``, results that are sums over the axis are allowed (not carrying it)."""
    body, got = reached
    if got.result_shares(body.jaxpr) and not sums:
        raise NoRule(f"{name}: the body sums over the split axis into a result")
    axes = got.axes
    ins = tuple(axes.get(v) for v in body.jaxpr.invars)
    outs = tuple(axes.get(v) for v in body.jaxpr.outvars)
    if (ins if side[0] == "in" else outs)[side[1]] != axis:
        raise NoRule(f"{name}: the split axis does not pass through the body")
    return Through(ins=ins, outs=outs, ctx=ctx)


def _side(m: Mapping) -> Side:
    """A side of the mapping that carries the split axis (an operand where one does)."""
    for kind, axes in (("in", m.ins), ("out", m.outs)):
        for k, a in enumerate(axes):
            if a is not None:
                return kind, k
    raise NoRule("the split axis passes through no operand or result")


def _chunk_fun(reached: BodySplit, n: int) -> Any:
    body, got = reached
    in_avals = [v.aval for v in body.jaxpr.invars]
    return jaxpr_as_fun(loop_body.chunk_body(body, got, n, in_avals))


def _call(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    inner = ctx.in_body()
    return _mapping(eqn.primitive.name, _axes(_body(eqn), side, axis, inner), side, axis, inner)


def _rebind_call(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """The body re-traced on the chunk (its start as one more operand), checkpointed again
    where the call was a checkpoint."""
    assert isinstance(m, Through)
    side = _side(m)
    axis = (m.ins if side[0] == "in" else m.outs)[side[1]]
    fun = checkpointed_like(eqn, _chunk_fun(_axes(_body(eqn), side, axis, m.ctx), n))
    return list(fun(jnp.asarray(start, jnp.int32), *invals))


split_rule(*CALLS, rebind=_rebind_call)(_call)


def _in_branch(side: Side) -> Side:
    """A cond's side as its branches see it (its operand k is their input k-1)."""
    if side == ("in", 0):
        raise NoRule("cond: the branch index is a scalar")
    return ("in", side[1] - 1) if side[0] == "in" else side


def _branches(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> list[BodySplit]:
    """Each branch reached from the split axis at ``side`` of the cond, in ``ctx`` (a body's
    context). Where the branches, each reached alone, carry the axis to different operands or
    results, each is reached again from all of them (:func:`_unified`)."""
    branches = [_inlined(b) for b in eqn.params["branches"]]
    reached, refusals = [], []
    for b in branches:
        try:
            reached.append(_axes(b, _in_branch(side), axis, ctx, same=True))
        except NoRule as err:  # a branch that makes the result: reached from the others
            refusals.append(err)
    if not refusals and len({_sides(r) for r in reached}) == 1:
        return reached
    if not reached:
        raise refusals[0]
    return _unified(eqn, branches, reached, ctx)


def _sides(reached: BodySplit) -> tuple[tuple, tuple]:
    """(operand axes, result axes) of a reached branch."""
    body, got = reached
    jaxpr = body.jaxpr
    return (
        tuple(got.axes.get(v) for v in jaxpr.invars),
        tuple(got.axes.get(v) if isinstance(v, Var) else None for v in jaxpr.outvars),
    )


def _unified(
    eqn: JaxprEqn, branches: list[ClosedJaxpr], reached: list[BodySplit], ctx: RuleContext
) -> list[BodySplit]:
    """The branches reached again from every operand and result any of them carries the axis
    at, until they agree: a branch that does not read an operand takes it chunked all the same,
    and one that makes a result (a broadcast constant) makes it at chunk shape. Refused where
    two branches carry the axis at different places of one operand or result, or a branch
    cannot give a result the axis the others give it (one it computes from values read whole)."""
    for _ in range(2 * len(branches[0].jaxpr.invars) + 2):
        ins: dict[int, int] = {}  # operand (result) position -> axis, from every branch
        outs: dict[int, int] = {}
        for r in reached:
            operands, results = _sides(r)
            for known, axes in ((ins, operands), (outs, results)):
                for k, a in enumerate(axes):
                    if a is not None and known.setdefault(k, a) != a:
                        raise NoRule(
                            "cond: its branches carry the split axis to different places of "
                            "one operand or result"
                        )
        again = _reach_each(
            eqn, branches, ins, outs, ctx,
            "cond: its branches carry the split axis to different operands or results: "
            "branch {k} {what} ({err})",
        )  # fmt: skip
        if len({_sides(r) for r in again}) == 1:  # every branch as the others
            return again
        reached = again
    raise NoRule("cond: its branches never settle on the split axis")


def _cond(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """Operands and results at the axes every branch gives them (the index whole); a result
    some branch sums over the axis into is a sum of the chunks' results (:func:`_summed`)."""
    inner = ctx.in_body()
    return _through(eqn, _branches(eqn, side, axis, inner), _in_branch(side), axis, inner)


def _through(
    eqn: JaxprEqn, reached: list[BodySplit], branch: Side, axis: int, ctx: RuleContext
) -> Through:
    """The cond's mapping from its branches (reached in ``ctx``, the axis at ``branch`` of
    each), which must agree."""
    _summed(reached, eqn)
    found = {_mapping("cond", r, branch, axis, ctx, sums=True) for r in reached}
    if len(found) != 1:
        raise NoRule("cond: its branches carry the split axis to different operands or results")
    (m,) = found
    return Through(ins=(None, *m.ins), outs=m.outs, ctx=ctx)


def _seeded(
    eqn: JaxprEqn, ins: dict[int, int], outs: dict[int, int], ctx: RuleContext
) -> list[BodySplit]:
    """Each branch reached from the branch inputs at ``ins`` and the results at ``outs``
    (position -> axis) together, until the branches agree (:func:`_unified`): a branch that
    passes an operand to a result gives that result the axis, and every other branch must give
    it too, computing it from chunked operands or making it at chunk shape (a broadcast, a
    zeros fill). Refused naming the operand and the result where a branch cannot."""
    branches = [_inlined(b) for b in eqn.params["branches"]]
    reached = _reach_each(eqn, branches, ins, outs, ctx, "cond: branch {k} {what}: {err}")
    if len({_sides(r) for r in reached}) == 1:
        return reached
    return _unified(eqn, branches, reached, ctx)


def _reach_each(
    eqn: JaxprEqn,
    branches: list[ClosedJaxpr],
    ins: dict[int, int],
    outs: dict[int, int],
    ctx: RuleContext,
    refusal: str,
) -> list[BodySplit]:
    """Each branch reached from the inputs at ``ins`` and the results at ``outs`` together;
    where one cannot be, ``refusal`` (formatted with the branch ``k``, what it cannot do,
    :func:`_naming`, and the walk's error ``err``)."""
    reached = []
    for k, b in enumerate(branches):
        try:
            reached.append((b, loop_body.reach_seeded(b.jaxpr, ins, outs, ctx, sums=True)))
        except NoRule as err:
            what = _naming(eqn, b, ins, outs, ctx)
            raise NoRule(refusal.format(k=k, what=what, err=err)) from None
    return reached


def _naming(
    eqn: JaxprEqn, b: ClosedJaxpr, ins: dict[int, int], outs: dict[int, int], ctx: RuleContext
) -> str:
    """What branch ``b`` cannot do, reached from the inputs at ``ins`` and the results at
    ``outs``: give one of those results the axis (named with its value), or take the operands
    chunked."""
    operands = ", ".join(f"{k + 1} ({eqn.invars[k + 1].aval.str_short()})" for k in sorted(ins))
    try:
        loop_body.reach_seeded(b.jaxpr, ins, {}, ctx, sums=True)
    except NoRule:
        return f"cannot take the split axis of operands {operands}"
    for o, a in sorted(outs.items()):
        try:
            loop_body.reach_seeded(b.jaxpr, ins, {o: a}, ctx, sums=True)
        except NoRule:
            aval = eqn.outvars[o].aval.str_short()
            return f"cannot give result {o} ({aval}) the split axis of operands {operands}"
    return f"cannot take the split axis of operands {operands}"


def _widen(eqn: JaxprEqn, m: Mapping | None, ins: dict[int, int], ctx: RuleContext) -> Mapping:
    """The cond mapped as ``m`` (None: refused from one operand alone) where the operands at
    ``ins`` (cond operand position -> axis) carry the split axis too: one branch passes such
    an operand to a result (a carry it keeps) that another computes, so every branch is
    reached again from all of them (:func:`_seeded`). Each branch then gives every such result
    the same positions of the same chunk, computed from chunked operands or made at chunk
    shape, so the chunk's results are the chunk of the cond's whichever branch the index
    picks."""
    inner = ctx.in_body() if m is None else m.ctx
    seeds = {k - 1: a for k, a in enumerate(m.ins) if a is not None} if m is not None else {}
    for k, a in ins.items():
        if k == 0:
            raise NoRule("cond: the branch index is a scalar")
        if seeds.setdefault(k - 1, a) != a:
            raise NoRule(
                f"cond: operand {k} ({eqn.invars[k].aval.str_short()}) is chunked along "
                "another axis than its branches read it"
            )
    outs = {k: a for k, a in enumerate(m.outs) if a is not None} if m is not None else {}
    (k, a), *_ = sorted(seeds.items())
    return _through(eqn, _seeded(eqn, seeds, outs, inner), ("in", k), a, inner)


def _reached_of(eqn: JaxprEqn, m: Mapping) -> list[BodySplit]:
    """The branches of a cond mapped as ``m``: reached from its first chunked operand or
    result, or where that gives another mapping (one :func:`_widen` made), from all."""
    assert isinstance(m, Through)
    side = _side(m)
    axis = (m.ins if side[0] == "in" else m.outs)[side[1]]
    want = (tuple(m.ins[1:]), tuple(m.outs))
    try:
        reached = _branches(eqn, side, axis, m.ctx)
    except NoRule:  # a mapping widened from a refusal
        reached = []
    if reached and all(_sides(r) == want for r in reached):
        return reached
    ins = {k - 1: a for k, a in enumerate(m.ins) if a is not None}
    outs = {k: a for k, a in enumerate(m.outs) if a is not None}
    reached = _seeded(eqn, ins, outs, m.ctx)
    if not all(_sides(r) == want for r in reached):
        raise NoRule("cond: its branches do not settle on the widened split axis")
    return reached


def _rebind_cond(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """The chunk through the branch the index picks, each branch re-traced at chunk shape."""
    funs = [_chunk_fun(r, n) for r in _reached_of(eqn, m)]
    return list(lax.switch(invals[0], funs, jnp.asarray(start, jnp.int32), *invals[1:]))


def _is_zero(jaxpr: Jaxpr, atom: Any) -> bool:
    """Whether ``atom`` is a zero literal or a zero literal broadcast (a branch's cotangent of an
    operand it does not read)."""
    if isinstance(atom, Literal):
        return not np.any(np.asarray(atom.val))
    eqn = next((e for e in jaxpr.eqns if atom in e.outvars), None)
    return (
        eqn is not None
        and eqn.primitive.name == "broadcast_in_dim"
        and _is_zero(jaxpr, eqn.invars[0])
    )


def _summed(reached: list[BodySplit], eqn: JaxprEqn | None = None) -> frozenset[int]:
    """Positions of the results some branch sums over the split axis into (a contraction's
    cotangent): each other branch must sum into it too, or make it zero, so that the chunks'
    results add up to the cond's whichever branch the index picks. Refused otherwise (naming
    the result's value where ``eqn``, the cond, is given)."""
    sums = {k for body, got in reached for k in got.result_shares(body.jaxpr)}
    for k in sorted(sums):
        for body, got in reached:
            out = body.jaxpr.outvars[k]
            if not (out in got.shares or _is_zero(body.jaxpr, out)):
                value = "" if eqn is None else f" ({eqn.outvars[k].aval.str_short()})"
                raise NoRule(
                    f"cond: a branch sums over the split axis into result {k}{value}, another "
                    "gives it a value that is no such sum"
                )
    return frozenset(sums)


def _cond_sums(eqn: JaxprEqn, m: Mapping) -> frozenset[int]:
    """The summed results (:func:`_summed`) of a cond mapped as ``m``."""
    return _summed(_reached_of(eqn, m))


@dataclass(frozen=True)
class Same(Running):
    """A cond some of whose results do not carry the split axis: those that read nothing of it
    (a solver's step counter beside its state) are the same on every chunk, the last chunk's
    are the results after the loop; those its branches sum over the axis into are added up
    over the chunks. Inside a loop body, where a chunk's sum is no result, only the first kind
    is read whole.

    The carried value is (the sums so far, the last chunk's same results), each keyed by result
    position, of those in ``kept`` (None: all)."""

    kept: frozenset[int] | None = None

    def applies(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        return None in mapping.outs

    def keeping(self, eqn: JaxprEqn, mapping: Mapping, live: frozenset[int]) -> Same | None:
        return Same(live) if live else None

    def record(
        self, eqn: JaxprEqn, outs: list[Any], mapping: Mapping, size: int, carried: Any
    ) -> tuple[list[Any], Any]:
        kept = frozenset(range(len(outs))) if self.kept is None else self.kept
        sums = _cond_sums(eqn, mapping) & kept
        return loop_body.summed_record(outs, mapping, kept, sums, carried)

    def finals(self, eqn: JaxprEqn, carried: Any) -> dict[int, Any]:
        return loop_body.summed_finals(carried)

    def same_inside(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        return not _cond_sums(eqn, mapping)


split_rule("cond", rebind=_rebind_cond, running=(Same(),), widen=_widen)(_cond)
