"""A split axis through a loop body: which body values carry it, and the body on a chunk.

A loop whose body maps the split axis through every equation (a batch of rows through a scan
over time or layers) runs chunk by chunk like any other equation: each chunk runs the whole loop
on its rows. :func:`propagate` finds where the axis sits in each body value from where it sits in
some of the body's inputs, growing that set to a fixed point (a loop carry that takes the axis in
must give it back, and one that gives it back must take it in). It refuses a body that reads a
chunked value whole. A loop's result that does not carry the axis is either a *share*: a sum
over the axis (a layer's parameter gradient, summed over the batch) that reaches the result
only through operations linear in it (:mod:`memsafe.split.linear`), so that the chunks' shares
add up to the result; or it reads nothing of the axis (a loop counter) and is the same on every
chunk. A carry may be such a sum too (an accumulated gradient), when the body is linear in it.
Other bodies (calls) must give every result the axis. :func:`chunk_body` is the body re-traced
on chunk-shaped operands.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax import lax

from memsafe import policy
from memsafe._jax import ClosedJaxpr, Jaxpr, JaxprEqn, Literal, Var, bind_eqn, is_var
from memsafe.flops import jaxpr_flops
from memsafe.graph.interpret import evaluate_eqns
from memsafe.primitives import Scaling, facts
from memsafe.split import registry, sinks
from memsafe.split.linear import Role, keeps_sums
from memsafe.split.registry import Mapping, NoRule
from memsafe.split.sinks import Sink

#: The jaxprs of loop bodies a split rule re-traced per chunk whose iterations still make values
#: as large as the loop's own (memsafe.split.strategies.replay's: the term added to an accumulator's
#: chunk).
_MAKES_WHOLE: weakref.WeakSet = weakref.WeakSet()


def mark_makes_whole(body: ClosedJaxpr) -> None:
    """Say that ``body``, a loop body a split rule made, still makes its large values whole in
    each iteration: the split pass splits inside it wherever it sits (:func:`makes_whole`)."""
    _MAKES_WHOLE.add(body.jaxpr)


def makes_whole(body: ClosedJaxpr) -> bool:
    """Whether ``body`` is a loop body a split rule made that still makes its large values
    whole (:func:`mark_makes_whole`): in a chunk loop's body, or in its first or last chunk
    under ``jax.checkpoint``, the split pass splits inside it."""
    return body.jaxpr in _MAKES_WHOLE


#: Where the axis sits in each body value that carries it.
Axes = dict[Var, int]
#: Reductions whose chunk results add up: a chunk's sum or contraction is its share.
_SUMS = (sinks.SUM, sinks.DOT)


class Reached(NamedTuple):
    """A body split along an axis: where each value carries it, the mapping of each equation
    that touches it (a :class:`Sink` for those summing over it), and the shares: values that
    are each chunk's share of a sum over the axis."""

    axes: Axes
    maps: dict[int, Mapping | Sink]
    shares: frozenset[Var]

    def result_shares(self, jaxpr: Jaxpr) -> tuple[int, ...]:
        """Positions of the body's results that are shares."""
        return tuple(k for k, v in enumerate(jaxpr.outvars) if v in self.shares)


def propagate(
    jaxpr: Jaxpr,
    seeds: dict[Any, int],
    ctx: registry.RuleContext,
    tied: Sequence[tuple[int, int]] = (),
    sums: bool = False,
) -> Reached:
    """The axis of every body value that carries it, each equation's mapping, and the shares.

    Args:
        jaxpr: the loop body.
        seeds: body input position -> axis, where the chunked operands enter.
        ctx: what the split rules are told (a body's context: plain chunks).
        tied: (input position, output position) pairs that must agree (a loop's carry).
        sums: whether the body is a loop's, whose runner adds the chunks' shares and takes
            the results that read nothing of the axis from any chunk (a ``fori_loop``'s
            counter: every chunk runs the whole loop, so each gives the same); otherwise a sum
            over the axis stops it, and so does a result without the axis.

    Returns:
        The split of the body. Raises :class:`NoRule` naming what stops the axis.
    """
    seeds = dict(seeds)
    carries = frozenset(i for i, _ in tied)
    for _ in range(2 * len(jaxpr.invars) + 1):
        pulled = dict(seeds)  # the walk adds the inputs chunked operands are computed from
        try:
            got = _Walk(jaxpr, pulled, carries, sums, ctx).run()
        except _ShareCarry as share:  # a carry accumulates a sum: it is one too
            seeds[("share", share.position)] = 0
            continue
        grown = _tie(jaxpr, got, pulled, tied, ctx, settled=pulled == seeds)
        if grown == seeds:
            (_check_same if sums else _check_outputs)(jaxpr, got)
            return got
        seeds = grown
    raise NoRule("the loop carry never settles on the split axis")


def reach(
    jaxpr: Jaxpr,
    ins: dict[int, int],
    outs: dict[int, int],
    ctx: registry.RuleContext,
    tied: Sequence[tuple[int, int]] = (),
    sums: bool = False,
) -> Reached:
    """:func:`propagate` from the body inputs in ``ins``; with none, from the first body input
    axis that lands on the one result in ``outs`` (a result is reached from the inputs).

    Answers (and refusals) are remembered per body, seeds and context: region growth asks the
    same loop the same question once per candidate value and axis, and each answer walks the
    whole body.
    The returned dicts are shared: read them, do not change them."""
    got, err = _reach_once(
        jaxpr, tuple(sorted(ins.items())), tuple(sorted(outs.items())), ctx, tuple(tied), sums
    )
    if err is not None:
        raise NoRule(str(err), inherent=err.inherent)
    return got


@functools.lru_cache(maxsize=1024)
def _reach_once(
    jaxpr: Jaxpr, ins: tuple, outs: tuple, ctx: registry.RuleContext, tied: tuple, sums: bool
) -> tuple[Reached | None, NoRule | None]:
    try:
        return _reach(jaxpr, dict(ins), dict(outs), ctx, tied, sums), None
    except NoRule as err:
        return None, err


def _reach(
    jaxpr: Jaxpr,
    ins: dict[int, int],
    outs: dict[int, int],
    ctx: registry.RuleContext,
    tied: Sequence[tuple[int, int]],
    sums: bool,
) -> Reached:
    if ins:
        return propagate(jaxpr, ins, ctx, tied, sums)
    (o, a), target = next(iter(outs.items())), jaxpr.outvars
    for k, v in enumerate(jaxpr.invars):
        for b in range(len(v.aval.shape)):
            try:
                got = propagate(jaxpr, {k: b}, ctx, tied, sums)
            except NoRule:
                continue
            if got.axes.get(target[o]) == a:
                return got
    raise NoRule("no input of the body carries the split axis to this result")


def reach_seeded(
    jaxpr: Jaxpr,
    ins: dict[int, int],
    outs: dict[int, int],
    ctx: registry.RuleContext,
    sums: bool = False,
) -> Reached:
    """:func:`propagate` from the body inputs in ``ins`` and from each result in ``outs`` (result
    position -> axis) pulled back to the inputs it is computed from or to the generator that makes
    it (a branch of a ``cond`` that makes a result by broadcasting a constant where the others
    compute it from an operand). Every result in ``outs`` must come out at its axis.

    Remembered like :func:`reach`; raises :class:`NoRule` naming the result that cannot."""
    ins_, outs_ = tuple(sorted(ins.items())), tuple(sorted(outs.items()))
    got, err = _seeded_once(jaxpr, ins_, outs_, ctx, sums)
    if err is not None:
        raise NoRule(str(err), inherent=err.inherent)
    return got


@functools.lru_cache(maxsize=1024)
def _seeded_once(
    jaxpr: Jaxpr, ins: tuple, outs: tuple, ctx: registry.RuleContext, sums: bool
) -> tuple[Reached | None, NoRule | None]:
    seeds: dict[Any, int] = dict(ins)
    try:
        for o, a in outs:
            var = jaxpr.outvars[o]
            if not (isinstance(var, Var) and _pull(jaxpr, var, a, seeds, ctx)):
                raise NoRule(f"the body's result {o} cannot carry the split axis")
        got = propagate(jaxpr, seeds, ctx, sums=sums)
        for o, a in outs:
            if got.axes.get(jaxpr.outvars[o]) != a:
                raise NoRule(f"the body's result {o} does not carry the split axis where asked")
    except NoRule as err:
        return None, err
    return got, None


class _ShareCarry(Exception):
    """The carry input at ``position`` meets a sum over the split axis in a sum: it
    accumulates one, and the walk starts again with it as a share."""

    def __init__(self, position: int) -> None:
        self.position = position


class _Walk:
    """One walk in program order from the seeds: body inputs (by position), carries that are
    shares (``("share", position)``) and generators (``("made", equation, result)``: a
    broadcast or iota made at chunk shape)."""

    def __init__(
        self,
        jaxpr: Jaxpr,
        seeds: dict[Any, int],
        carries: frozenset[int],
        sums: bool,
        ctx: registry.RuleContext,
    ) -> None:
        self.jaxpr, self.seeds, self.carries, self.sums = jaxpr, seeds, carries, sums
        self.ctx = ctx
        self.producer = {o: e for e in jaxpr.eqns for o in e.outvars}
        self.axes: Axes = {jaxpr.invars[k]: a for k, a in seeds.items() if isinstance(k, int)}
        keyed = [k for k in seeds if isinstance(k, tuple)]
        self.shares = {jaxpr.invars[k[1]] for k in keyed if k[0] == "share"}
        self.zeros: set[Var] = set()
        self.maps: dict[int, Mapping | Sink] = {}

    def role(self, atom: Any) -> Role:
        if isinstance(atom, Literal):
            return Role.ZERO if not np.any(np.asarray(atom.val)) else Role.WHOLE
        if atom in self.axes:
            return Role.SPLIT
        if atom in self.shares:
            return Role.SHARE
        return Role.ZERO if atom in self.zeros else Role.WHOLE

    def run(self) -> Reached:
        made = {
            k[1]: (k[2], a)
            for k, a in self.seeds.items()
            if isinstance(k, tuple) and k[0] == "made"
        }
        for i, eqn in enumerate(self.jaxpr.eqns):
            roles = [self.role(a) for a in eqn.invars]
            found = [(k, self.axes[v]) for k, v in enumerate(eqn.invars) if roles[k] is Role.SPLIT]
            if found:
                m = _axis_map(eqn, ("in", found[0][0]), found[0][1], self.ctx, dict(found))
                self.split(i, eqn, m, roles)
            elif i in made:
                m = _axis_map(eqn, ("out", made[i][0]), made[i][1], self.ctx)
                self.split(i, eqn, m, roles)
            elif Role.SHARE in roles:
                if not keeps_sums(eqn, roles):
                    self.accumulates(eqn, roles)
                    raise NoRule(
                        f"{eqn.primitive.name} inside the loop body is not linear in a sum over "
                        "the split axis"
                    )
                self.shares.update(eqn.outvars)
            elif eqn.primitive.name == "broadcast_in_dim" and roles[0] is Role.ZERO:
                self.zeros.update(eqn.outvars)
        return Reached(self.axes, self.maps, frozenset(self.shares))

    def accumulates(self, eqn: JaxprEqn, roles: list[Role]) -> None:
        """Raise :class:`_ShareCarry` where a sum adds a share to a value read whole that is
        computed from a carry input: the carry may accumulate a sum (``0.5 * c + sum(z)``)."""
        if facts(eqn.primitive.name).scaling is not Scaling.SAME:
            return
        for a, r in zip(eqn.invars, roles):
            for k in self.carries_under(a) if r is Role.WHOLE else ():
                if ("share", k) not in self.seeds and k not in self.seeds:
                    raise _ShareCarry(k)

    def carries_under(self, atom: Any) -> list[int]:
        """The carry input positions ``atom`` is computed from."""
        found, stack, seen = [], [atom], set()
        while stack:
            a = stack.pop()
            if not is_var(a) or a in seen:
                continue
            seen.add(a)
            if a in self.jaxpr.invars:
                k = self.jaxpr.invars.index(a)
                found += [k] if k in self.carries else []
            elif (eqn := self.producer.get(a)) is not None:
                stack.extend(eqn.invars)
        return found

    def split(self, i: int, eqn: JaxprEqn, m: Mapping | Sink, roles: list[Role]) -> None:
        """Equation ``i`` reads or makes the split axis and maps it as ``m``."""
        if Role.SHARE in roles:
            raise NoRule(
                f"{eqn.primitive.name} inside the loop body reads a sum over the split axis "
                "with values split along it"
            )
        if isinstance(m, Sink) and not (self.sums and m.reducer in _SUMS):
            raise NoRule(f"{eqn.primitive.name} inside the loop body reduces the split axis")
        _check_operands(eqn, m, self.axes, self.seeds, self.jaxpr, self.ctx)
        self.maps[i] = m
        if isinstance(m, Sink):
            self.shares.update(eqn.outvars)
            return
        same = None in m.outs and _same_inside(eqn, m)
        for o, ax in zip(eqn.outvars, m.outs):
            if ax is None and same:
                continue
            if ax is None:
                raise NoRule(f"{eqn.primitive.name} inside the loop body consumes the split axis")
            self.axes[o] = ax


def _axis_map(
    eqn: JaxprEqn,
    side: registry.Side,
    axis: int,
    ctx: registry.RuleContext,
    ins: dict[int, int] | None = None,
) -> Mapping | Sink:
    """The equation's mapping inside a loop body, where a scan along the axis (``cumsum``) has
    no running carry to thread from chunk to chunk: each chunk of the loop runs the whole body,
    so a chunk's scan would miss the rows of the chunks before it. With ``ins`` (operand
    position -> axis: every operand the walk has chunked), the mapping widened to them
    (:func:`registry.widen`)."""
    if ins and len(ins) > 1:
        try:
            first: Mapping | Sink | None = registry.axis_map(eqn, side, axis, ctx)
        except NoRule:  # refused from one operand alone: perhaps not from all of them
            first = registry.widen(eqn, None, ins, ctx)
        m = registry.widen(eqn, first, ins, ctx)
    else:
        m = registry.axis_map(eqn, side, axis, ctx)
    run = registry.running_along(eqn, m) if isinstance(m, Mapping) else None
    if run is not None and not run.same_inside(eqn, m):
        sink = run.sink(eqn, m)  # (a combining scatter: its chunks fold as a sink's)
        if sink is None:
            raise NoRule(f"{eqn.primitive.name} inside the loop body scans along the split axis")
        return sink
    return m


def _same_inside(eqn: JaxprEqn, m: Mapping) -> bool:
    """Whether ``eqn``'s results without the split axis are the same on every chunk (a nested
    loop's counter): read whole, as values that read nothing of the axis are."""
    run = registry.running_along(eqn, m)
    return run is not None and run.same_inside(eqn, m)


def _check_operands(
    eqn: JaxprEqn,
    m: Mapping | Sink,
    axes: Axes,
    seeds: dict[Any, int],
    jaxpr: Jaxpr,
    ctx: registry.RuleContext,
) -> None:
    """Every operand the mapping chunks must be chunked there, and no chunked operand may be
    read whole; a body input the mapping chunks joins the seeds on the next round."""
    for v, ax in zip(eqn.invars, m.ins):
        if not isinstance(v, Var):
            if ax is not None:
                raise NoRule(f"{eqn.primitive.name}: a constant would need the split axis")
            continue
        have = axes.get(v)
        if have == ax:
            continue
        if have is None and ax is not None and _pull(jaxpr, v, ax, seeds, ctx):
            continue
        raise NoRule(f"{eqn.primitive.name} inside the loop body reads a value both ways")


def _pull(
    jaxpr: Jaxpr,
    var: Var,
    axis: int,
    seeds: dict[Any, int],
    ctx: registry.RuleContext,
    done: dict[tuple[Var, int], bool] | None = None,
) -> bool:
    """Seed the body inputs ``var`` is computed from so that it comes out chunked along
    ``axis``, or its generator where no operand carries the axis (a broadcast mask made at
    chunk shape); the next forward walk checks the whole body again. False if it cannot.
    ``done`` holds the answers for values already walked: a body whose values share inputs many
    times over (the gradient of an associative scan) is walked once per value, not per path."""
    done = {} if done is None else done
    if (var, axis) not in done:
        done[(var, axis)] = _pull_once(jaxpr, var, axis, seeds, ctx, done)
    return done[(var, axis)]


def _pull_once(
    jaxpr: Jaxpr,
    var: Var,
    axis: int,
    seeds: dict[Any, int],
    ctx: registry.RuleContext,
    done: dict[tuple[Var, int], bool],
) -> bool:
    """:func:`_pull` of one value whose answer is not known yet."""
    if var in jaxpr.invars:
        k = jaxpr.invars.index(var)
        if seeds.get(k, axis) != axis:
            return False
        seeds[k] = axis
        return True
    index = next((i for i, e in enumerate(jaxpr.eqns) if var in e.outvars), None)
    if index is None:
        return False
    producer = jaxpr.eqns[index]
    try:
        m = _axis_map(producer, ("out", producer.outvars.index(var)), axis, ctx)
    except NoRule:
        return False
    if isinstance(m, Sink):
        return False
    pulled = [(v, a) for v, a in zip(producer.invars, m.ins) if a is not None]
    if not pulled:
        seeds[("made", index, producer.outvars.index(var))] = axis
        return True
    return all(isinstance(v, Var) and _pull(jaxpr, v, a, seeds, ctx, done) for v, a in pulled)


def _tie(
    jaxpr: Jaxpr,
    got: Reached,
    seeds: dict[Any, int],
    tied: Sequence[tuple[int, int]],
    ctx: registry.RuleContext,
    settled: bool = True,
):
    """The seeds grown by the carries: one whose result carries the axis (or is a share) takes
    it in the same way. A carry that takes the axis in but whose result the walk did not reach
    has the inputs its result is computed from seeded (:func:`_pull`: a state reloaded from a
    constant buffer each iteration, ``x = buffer[i]``, takes the buffer chunked); where the walk
    pulled inputs it had not started from (``settled`` false), the next walk may give it the
    axis from them. Refused where neither is so."""
    grown = dict(seeds)
    for i, o in tied:
        inner, outer = jaxpr.invars[i], jaxpr.outvars[o]
        have, share_in = grown.get(i), ("share", i) in grown
        out = got.axes.get(outer) if isinstance(outer, Var) else None
        share_out = isinstance(outer, Var) and outer in got.shares
        if share_out and have is not None:
            raise NoRule("a loop carry takes the split axis in and gives back a sum over it")
        if share_out:
            grown[("share", i)] = 0
        elif share_in and outer is not inner:
            raise NoRule("a loop carry takes a sum over the split axis in but not out")
        elif out is not None and have is None:
            grown[i] = out
        elif have is not None and out is None and outer is not inner:
            pulled = dict(grown)
            found = isinstance(outer, Var) and _pull(jaxpr, outer, have, pulled, ctx)
            if found and pulled != grown:
                grown = pulled
                continue
            if settled:
                raise NoRule("a loop carry takes the split axis in but not out")
        elif have is not None and out is not None and have != out:
            raise NoRule("a loop carry moves the split axis")
    return grown


def _check_outputs(jaxpr: Jaxpr, got: Reached) -> None:
    """Every result of a call's body must carry the axis: one that does not is the same on
    every chunk, which only a loop's runner takes from a chunk (a share is no call's result)."""
    for k, v in enumerate(jaxpr.outvars):
        if not (isinstance(v, Var) and (v in got.axes or v in got.shares)):
            raise NoRule(f"the body's result {k} does not carry the split axis")


def _check_same(jaxpr: Jaxpr, got: Reached) -> None:
    """A loop's results without the axis that are no shares read nothing of it: every chunk
    computes them again. Refuse them where the work only they need is more than a sliver of
    the body's."""
    split = [v for v in jaxpr.outvars if is_var(v) and (v in got.axes or v in got.shares)]
    same = [v for v in jaxpr.outvars if is_var(v) and v not in split]
    if not same:
        return
    extra = _cone(jaxpr, same) - _cone(jaxpr, split)
    work = jaxpr_flops(jaxpr.eqns[i] for i in extra)
    if work > max(
        policy.SPLIT.same_work_floor, policy.SPLIT.same_work_share * jaxpr_flops(jaxpr.eqns)
    ):
        k = jaxpr.outvars.index(same[0])
        raise NoRule(
            f"the loop's result {k} does not carry the split axis, and each chunk would compute "
            "it again"
        )


def _cone(jaxpr: Jaxpr, values: Sequence[Var]) -> set[int]:
    """Indices of the body equations ``values`` are computed from."""
    producer = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
    found: set[int] = set()
    stack = [producer[v] for v in values if v in producer]
    while stack:
        i = stack.pop()
        if i in found:
            continue
        found.add(i)
        stack.extend(producer[a] for a in jaxpr.eqns[i].invars if is_var(a) and a in producer)
    return found


def chunk_body(body: ClosedJaxpr, got: Reached, size: int, in_avals: Sequence[Any]) -> ClosedJaxpr:
    """The body on operands chunked to ``size`` along their axes, with the chunk's start as an
    extra first input (index arithmetic such as ``iota`` along the axis offsets by it). A sum
    over the axis is taken over the chunk: its result is the chunk's share."""
    jaxpr, axes, maps = body.jaxpr, got.axes, got.maps

    def run(start: Any, *args: Any) -> list[Any]:
        def bind(i: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
            m = maps.get(i)
            if isinstance(m, Mapping):
                return registry.rebind(eqn, invals, m, start, size)
            return bind_eqn(eqn, invals)

        env: dict[Var, Any] = dict(zip(jaxpr.constvars, body.consts))
        env.update(zip(jaxpr.invars, args))
        evaluate_eqns(jaxpr.eqns, range(len(jaxpr.eqns)), env, bind)
        return [env[a] if isinstance(a, Var) else a.val for a in jaxpr.outvars]

    chunked = [_chunk_aval(aval, axes.get(v), size) for v, aval in zip(jaxpr.invars, in_avals)]
    start = jax.ShapeDtypeStruct((), jax.numpy.int32)
    return jax.make_jaxpr(run)(start, *chunked)


def _chunk_aval(aval: Any, axis: int | None, size: int) -> jax.ShapeDtypeStruct:
    shape = list(aval.shape)
    if axis is not None:
        shape[axis] = size
    return jax.ShapeDtypeStruct(tuple(shape), aval.dtype)


def summed_record(
    outs: list[Any], mapping: Mapping, kept: Any, sums: frozenset[int], carried: Any
) -> tuple[list[Any], Any]:
    """The carry of a loop's or cond's results without the split axis, after one more chunk
    (the running rules ``Summed`` of scans, ``Same`` of while loops and conds): the results at
    ``sums`` added to the chunks' shares so far, the other results in ``kept`` without the axis
    the same on every chunk (the last chunk's kept). The carried value is (sums, same), each
    keyed by result position."""
    same = {k: outs[k] for k in kept if mapping.outs[k] is None and k not in sums}
    if carried is None:
        return outs, ({k: outs[k] for k in sums}, same)
    return outs, ({k: lax.add(carried[0][k], outs[k]) for k in sums}, same)


def summed_finals(carried: Any) -> dict[int, Any]:
    """The results after the loop over chunks of a carry made by :func:`summed_record`."""
    return {**carried[0], **carried[1]}
