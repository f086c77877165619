"""While loops split through their carries: a loop whose body maps an axis of its carries
position by position (a batch of trajectories, a batch of systems) runs whole on each chunk of
that axis, each chunk's loop iterating until its own positions are done.

That is exact when the positions cannot tell how many iterations ran for the others:

- the predicate reads nothing of the axis (``i < steps``): every chunk runs as many iterations as
  the whole loop; carries without the axis (the counter) are the same on every chunk;
- the predicate is *batched* along the axis (what ``jax.vmap`` of a while loop with a per-position
  predicate makes: the predicate has the carries' leading batch axes, the loop runs while any
  position's is true, and a position whose predicate is false keeps its carry: XLA selects the
  carry per position). A position then stops at its own iteration in any chunk;
- the predicate is ``any`` of a *mask* carried along the axis, as such a loop is written by hand
  (``while jnp.any(active)``, perhaps with a bound on the iterations ``&``-ed to it): the body
  only turns the mask off (``active & ...``) and keeps every other carry where it is off
  (``jnp.where(active, new, old)``). A position then stops changing at its own iteration, in a
  chunk as in the whole loop; carries without the axis (the iteration counter) run as far as
  the chunk's own positions do, so they are taken from the chunk whose counter ran furthest
  (:class:`Furthest`), as far as the whole loop's.

Any other predicate that reduces over the axis (a norm over the whole batch, one step size shared
by all trajectories) couples the positions: a chunk would stop when its own positions agree, not
when all do. Such a loop is refused, naming the predicate's reduction; so is a body that mixes
positions (a sum over the axis into a carry, a carry that takes the axis in but gives back
something else).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import ClosedJaxpr, JaxprEqn, Literal, bind_eqn_with, is_var
from memsafe.graph.bodies import inputs_under
from memsafe.graph.interpret import inline_calls
from memsafe.split import body as loop_body
from memsafe.split.registry import Mapping, NoRule, RuleContext, Running, Side, Through, split_rule
from memsafe.split.sinks import additive_identity


@functools.lru_cache(maxsize=64)
def _inlined(closed: Any) -> ClosedJaxpr:
    """A loop's cond or body with its nested calls inlined."""
    return inline_calls(closed)


def _counts(eqn: JaxprEqn) -> tuple[int, int, int]:
    """(cond constants, body constants, carries) among the loop's operands."""
    c, b = eqn.params["cond_nconsts"], eqn.params["body_nconsts"]
    return c, b, len(eqn.invars) - c - b


def _predicate_rank(eqn: JaxprEqn) -> int:
    """How many leading carry axes the predicate is batched over (0: a scalar predicate)."""
    return len(eqn.params["cond_jaxpr"].out_avals[0].shape)


@dataclass(frozen=True)
class _Split:
    """A while loop split through its state: the body's and the cond's splits."""

    body: ClosedJaxpr
    body_got: loop_body.Reached
    cond: ClosedJaxpr
    cond_got: loop_body.Reached
    #: Under a predicate that is ``any`` of a mask (:func:`_masked`): the position of the
    #: iteration counter among the carries, or -1 where no carry lacks the axis; else None.
    counter: int | None = None


def _describe(eqn: JaxprEqn, k: int) -> str:
    aval = eqn.outvars[k].aval
    return f"carry {k} ({aval.str_short()})"


def _reach(
    eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext, more: tuple[tuple[int, int], ...] = ()
) -> _Split:
    """The loop's body and cond reached from the split axis at ``side`` (``ctx``: a body's),
    and from the operands at ``more`` ((operand position, axis) pairs: those a region chunks
    beside it, :func:`_widen`)."""
    c, b, n = _counts(eqn)
    body, cond = _inlined(eqn.params["body_jaxpr"]), _inlined(eqn.params["cond_jaxpr"])
    a = axis
    seeds: dict[int, int] = {}
    for first, ((kind, j), ax) in enumerate(((side, axis), *((("in", p), x) for p, x in more))):
        if kind == "out":
            seeds[b + j] = ax
        elif j >= c:  # a body constant or a carry
            seeds[j - c] = ax
        elif first == 0 or not any(eqn.invars[c + i] is eqn.invars[j] for i in range(b)):
            # (a cond constant the body reads too takes the axis from the body's reading)
            raise NoRule(
                "while: the split axis enters the loop's predicate only (a constant it compares "
                "the carries with), not its state"
            )
    rank = _predicate_rank(eqn)
    if rank and a < rank:
        # a batched predicate selects every carry per position: all take the axis
        seeds.update({b + j: a for j in range(n)})
    tied = [(b + j, j) for j in range(n)]
    try:
        got = loop_body.reach(body.jaxpr, seeds, {}, ctx, tied, sums=True)
    except NoRule as err:
        raise NoRule(
            f"while: the body does not map the split axis position by position: {err}"
        ) from None
    shares = got.result_shares(body.jaxpr)
    if shares and rank and a < rank:
        raise NoRule(
            f"while: the body sums over the split axis into {_describe(eqn, shares[0])} under a "
            "batched predicate: each chunk's loop runs its own number of iterations, so the "
            "chunks' sums are not the loop's"
        )
    carried = {j: got.axes[v] for j, v in enumerate(body.jaxpr.invars[b:]) if v in got.axes}
    for j, v in enumerate(body.jaxpr.outvars):
        if is_var(v) and got.axes.get(v) != carried.get(j):
            raise NoRule(f"while: {_describe(eqn, j)} does not keep the split axis in place")
    if rank and a < rank and len(carried) < n:
        j = next(j for j in range(n) if j not in carried)
        raise NoRule(f"while: the batched predicate selects {_describe(eqn, j)} per position")
    cond_seeds = {c + j: ax for j, ax in carried.items()}
    cond_seeds.update({j: ax for j, ax in _const_axes(eqn, got, body).items()})
    try:
        cond_got, counter = _reach_cond(eqn, cond, cond_seeds, ctx, rank, a), None
    except NoRule as err:
        if rank:
            raise
        cond_got, counter = _masked(eqn, body, cond, cond_seeds, carried, err)
        if shares:
            raise NoRule(
                f"while: the body sums over the split axis into {_describe(eqn, shares[0])} "
                "under a predicate that is any of a mask: each chunk's loop runs its own number "
                "of iterations, so the chunks' sums are not the loop's"
            ) from None
    (pred,) = cond.jaxpr.outvars
    if shares and is_var(pred) and pred in cond_got.axes:
        raise NoRule(
            f"while: the body sums over the split axis into {_describe(eqn, shares[0])} and the "
            "predicate is per position: each chunk's loop runs its own number of iterations, "
            "so the chunks' sums are not the loop's"
        )
    read = inputs_under(cond.jaxpr, [pred])
    for j in shares:
        if j < n and c + j in read:
            raise NoRule(
                f"while: the predicate reads {_describe(eqn, j)}, a sum over the split axis the "
                "loop accumulates: each chunk would stop at its own share, not at the sum"
            )
    return _Split(body, got, cond, cond_got, counter)


def _masked(
    eqn: JaxprEqn,
    body: ClosedJaxpr,
    cond: ClosedJaxpr,
    seeds: dict[int, int],
    carried: dict[int, int],
    err: NoRule,
) -> tuple[loop_body.Reached, int]:
    """The cond on chunks where the predicate is ``any`` of a mask carried along the axis that
    the body only turns off and under which it keeps every other carry (see the module); the
    position of the carry counting the iterations (-1: every carry has the axis). Raises
    ``err``, the predicate's coupling, where the loop is not of that form."""
    c, b, n = _counts(eqn)
    cj, bj = cond.jaxpr, body.jaxpr
    along = {cj.invars[p]: ax for p, ax in seeds.items()}
    anys: dict[Any, Any] = {}  # reduce_or result -> the mask it reduces
    for e in cj.eqns:
        read = [v for v in e.invars if is_var(v) and v in along]
        if not read:
            continue
        mask = read[0]
        whole = set(e.params.get("axes", ())) == set(range(len(mask.aval.shape)))
        if e.primitive.name != "reduce_or" or len(e.invars) != 1 or not whole:
            raise err
        anys[e.outvars[0]] = mask
    (pred,) = cj.outvars
    leaves = _conjuncts(_producers(cj), pred)
    masks = {anys[v] for v in leaves if v in anys}
    position = {v: k for k, v in enumerate(cj.invars)}
    others = [v for v in leaves if v not in anys]
    if len(masks) != 1 or len(anys) != len([v for v in leaves if v in anys]):
        raise err
    if any(inputs_under(cj, [v]) & set(seeds) for v in others):
        raise err
    (mask,) = masks
    k = position[mask] - c
    ins, outs, producer = bj.invars[b:], bj.outvars, _producers(bj)
    if not _only_off(producer, outs[k], ins[k]):
        raise err
    for j in carried:
        changed = j != k and outs[j] is not ins[j]
        if changed and not _kept_where_off(producer, outs[j], ins[j], ins[k]):
            raise NoRule(
                f"while: the loop stops on any of {_describe(eqn, k)}, but the body changes "
                f"{_describe(eqn, j)} where that mask is off"
            )
    counter = _counter(bj, producer, b, n, carried)
    if counter is None:
        j = next(j for j in range(n) if j not in carried)
        raise NoRule(
            f"while: the loop stops on any of {_describe(eqn, k)}, so each chunk runs its own "
            f"number of iterations, and {_describe(eqn, j)} lacks the split axis with no "
            "iteration counter to tell which chunk ran as far as the loop"
        )
    return loop_body.Reached(dict(along), {}, frozenset()), counter


def _producers(jaxpr: Any) -> dict[Any, JaxprEqn]:
    return {o: e for e in jaxpr.eqns for o in e.outvars}


def _conjuncts(producer: dict[Any, JaxprEqn], var: Any) -> list[Any]:
    """The values ``var`` is the conjunction of (through ``and`` and conversions to bool), each
    value's equation in ``producer``."""
    out, stack = [], [var]
    while stack:
        v = stack.pop()
        e = producer.get(v) if is_var(v) else None
        if e is not None and e.primitive.name == "and" and v.aval.dtype == bool:
            stack.extend(e.invars)
        elif (
            e is not None
            and e.primitive.name == "convert_element_type"
            and (e.invars[0].aval.dtype == bool)
        ):
            stack.append(e.invars[0])
        else:
            out.append(v)
    return out


def _only_off(producer: dict[Any, JaxprEqn], out: Any, mask: Any) -> bool:
    """Whether the body's new mask ``out`` is off wherever the old one, ``mask``, is: the mask
    itself, or ``mask & ...``."""
    return out is mask or mask in _conjuncts(producer, out)


def _kept_where_off(producer: dict[Any, JaxprEqn], out: Any, old: Any, mask: Any) -> bool:
    """Whether ``out`` is ``old`` wherever ``mask`` is off: ``select_n(m, old, new)`` with ``m``
    the mask, broadcast."""
    e = producer.get(out) if is_var(out) else None
    if e is None or e.primitive.name != "select_n" or len(e.invars) != 3 or e.invars[1] is not old:
        return False
    m = e.invars[0]
    while is_var(m) and m is not mask:
        p = producer.get(m)
        if p is None or p.primitive.name != "broadcast_in_dim":
            return False
        m = p.invars[0]
    return m is mask


def _counter(
    jaxpr: Any, producer: dict[Any, JaxprEqn], b: int, n: int, carried: dict[int, int]
) -> int | None:
    """The carry the body adds a positive constant to (the iteration counter) among those
    without the axis: -1 where every carry has the axis, None where none is a counter."""
    if len(carried) == n:
        return -1
    for j in range(n):
        if j in carried:
            continue
        e = producer.get(jaxpr.outvars[j]) if is_var(jaxpr.outvars[j]) else None
        if e is None or e.primitive.name != "add" or jaxpr.invars[b + j].aval.shape != ():
            continue
        step = [v for v in e.invars if v is not jaxpr.invars[b + j]]
        if len(step) == 1 and isinstance(step[0], Literal) and step[0].val > 0:
            return j
    return None


def _const_axes(eqn: JaxprEqn, got: loop_body.Reached, body: ClosedJaxpr) -> dict[int, int]:
    """Cond constants that are body constants (the same outer value) carrying the axis: the
    predicate reads their chunk too."""
    c, b, _ = _counts(eqn)
    outer = {
        eqn.invars[c + j]: got.axes[v] for j, v in enumerate(body.jaxpr.invars[:b]) if v in got.axes
    }
    return {j: outer[v] for j, v in enumerate(eqn.invars[:c]) if is_var(v) and v in outer}


def _reach_cond(
    eqn: JaxprEqn,
    cond: ClosedJaxpr,
    seeds: dict[int, int],
    ctx: RuleContext,
    rank: int,
    axis: int,
) -> loop_body.Reached:
    """The cond reached from the carries' axes: the predicate must be per position (batched
    along the axis) or read nothing of it."""
    if not seeds:
        return loop_body.Reached({}, {}, frozenset())
    pulled = dict(seeds)
    try:
        got = loop_body._Walk(cond.jaxpr, pulled, frozenset(), False, ctx).run()
    except NoRule as err:
        raise NoRule(
            f"while: the loop's predicate couples the positions along the split axis ({err}): "
            "a chunk would stop when its own positions are done, not when all are"
        ) from None
    if pulled != seeds:
        raise NoRule("while: the loop's predicate reads a constant along the split axis")
    (pred,) = cond.jaxpr.outvars
    have = got.axes.get(pred) if is_var(pred) else None
    if have is not None and (have != axis or axis >= rank):
        raise NoRule("while: the predicate carries the split axis elsewhere than the carries")
    return got


def _while(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """Operands and results at the axes the body gives the carries; constants at the axes the
    body and cond read them at (a cond constant carrying the axis is refused)."""
    inner = ctx.in_body()
    return _through(eqn, _reach(eqn, side, axis, inner), side, axis, inner)


def _widen(eqn: JaxprEqn, m: Mapping | None, ins: dict[int, int], ctx: RuleContext) -> Mapping:
    """The loop mapped as ``m`` (None: refused from one operand alone) where the operands at
    ``ins`` carry the split axis too (body constants its body reads apart from the chunked
    carries: per-trajectory times beside the state): the body and cond reached from all of
    them. Exact as any split through the body: each chunk's loop reads the chunk of every
    operand that carries the axis, and the walk checks that no value is read both ways."""
    more = dict(ins)
    if m is not None:
        assert isinstance(m, Through)
        side = _side_of(m)
        axis = (m.ins if side[0] == "in" else m.outs)[side[1]]
        more.update({p: a for p, a in enumerate(m.ins) if a is not None})
        inner = m.ctx
    else:
        (p, axis), *_ = sorted(ins.items())
        side, inner = ("in", p), ctx.in_body()
    for p, a in ins.items():
        if more[p] != a:
            raise NoRule(
                f"while: operand {p} ({eqn.invars[p].aval.str_short()}) is chunked along "
                "another axis than the loop reads it"
            )
    more_ = tuple(sorted(more.items()))
    return _through(eqn, _reach(eqn, side, axis, inner, more_), side, axis, inner)


def _through(eqn: JaxprEqn, split: _Split, side: Side, axis: int, inner: RuleContext) -> Through:
    """The loop's mapping from its split."""
    c, b, _ = _counts(eqn)
    body_axes, cond_axes = split.body_got.axes, split.cond_got.axes
    cj, bj = split.cond.jaxpr, split.body.jaxpr
    ins = (
        *(cond_axes.get(v) for v in cj.invars[:c]),
        *(body_axes.get(v) for v in bj.invars[:b]),
        *(body_axes.get(v) for v in bj.invars[b:]),
    )
    outs = tuple(body_axes.get(v) for v in bj.invars[b:])
    for k in range(c):  # a cond constant must agree with the body's use of the same value
        v = eqn.invars[k]
        same = [ins[c + j] for j in range(b) if eqn.invars[c + j] is v]
        if any(s != ins[k] for s in same):
            raise NoRule("while: the cond and the body read a constant along different axes")
    given = ins[side[1]] if side[0] == "in" else outs[side[1]]
    if given != axis:
        raise NoRule("while: the split axis does not pass through the loop")
    return Through(ins=ins, outs=outs, ctx=inner)


@dataclass(frozen=True)
class Same(Running):
    """A while loop split through its state, some of whose carries lack the split axis, under a
    predicate that reads nothing of the axis (every chunk runs as many iterations as the loop).

    - A carry the body sums over the axis into (an accumulated gradient, summed over the batch)
      is the sum of each chunk's share: chunks after the first start it from zero (the body is
      linear in it, :mod:`memsafe.split.linear`).
    - A carry that reads nothing of the axis (the counter) is the same on every chunk: the last
      chunk's is the result.

    The carried value is (the shares summed so far, the last chunk's same results), each keyed
    by result position, of those in ``kept`` (None: all); ``zeroed``: the summed carries."""

    kept: frozenset[int] | None = None
    zeroed: frozenset[int] = frozenset()

    def applies(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        return None in mapping.outs

    def keeping(self, eqn: JaxprEqn, mapping: Mapping, live: frozenset[int]) -> Running | None:
        split = _split_of(mapping, eqn)
        if split.counter is not None:  # a masked loop: no sums (refused), counters run per chunk
            return Furthest(live, split.counter) if live else None
        shares = _summed(split)
        return Same(live, shares) if live or shares else None

    def feed(self, eqn: JaxprEqn, invals: list[Any], carried: Any) -> list[Any]:
        c, b, _ = _counts(eqn)
        fed = list(invals)
        for k in self.zeroed or _shares_of(carried):
            aval = eqn.invars[c + b + k].aval
            fed[c + b + k] = jnp.full(aval.shape, additive_identity(aval.dtype))
        return fed

    def record(
        self, eqn: JaxprEqn, outs: list[Any], mapping: Mapping, size: int, carried: Any
    ) -> tuple[list[Any], Any]:
        kept = frozenset(range(len(outs))) if self.kept is None else self.kept
        sums = _shares(eqn, mapping) & kept
        return loop_body.summed_record(outs, mapping, kept, sums, carried)

    def finals(self, eqn: JaxprEqn, carried: Any) -> dict[int, Any]:
        return loop_body.summed_finals(carried)

    def same_inside(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        # a masked loop's carries without the axis run per chunk (none where every carry has it)
        split = _split_of(mapping, eqn)
        return split.counter in (None, -1) and not _summed(split)


@dataclass(frozen=True)
class Furthest(Running):
    """A while loop split through its state under a predicate that is ``any`` of a mask: each
    chunk's loop runs until its own positions are done, so its carries without the split axis
    (which read nothing of it: the counter, values that follow it) are those of the whole loop
    after as many iterations. The chunk whose ``counter`` (a carry position) ran furthest ran as
    many as the whole loop: its results at positions ``kept`` are the results."""

    kept: frozenset[int]
    counter: int

    def applies(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        return None in mapping.outs

    def keeping(self, eqn: JaxprEqn, mapping: Mapping, live: frozenset[int]) -> Running | None:
        return Furthest(live, self.counter) if live else None

    def record(
        self, eqn: JaxprEqn, outs: list[Any], mapping: Mapping, size: int, carried: Any
    ) -> tuple[list[Any], Any]:
        now = {k: outs[k] for k in self.kept | {self.counter}}
        if carried is not None:
            behind = outs[self.counter] < carried[self.counter]
            now = {k: lax.select(behind, carried[k], v) for k, v in now.items()}
        return outs, now

    def finals(self, eqn: JaxprEqn, carried: Any) -> dict[int, Any]:
        return {k: carried[k] for k in self.kept}


def _split_of(m: Mapping, eqn: JaxprEqn) -> _Split:
    """The split of a loop mapped as ``m``: reached from its first chunked operand or result,
    or where that gives another mapping (one :func:`_widen` made), from all its operands."""
    assert isinstance(m, Through)
    side = _side_of(m)
    axis = (m.ins if side[0] == "in" else m.outs)[side[1]]
    try:
        split = _reach(eqn, side, axis, m.ctx)
        if _through(eqn, split, side, axis, m.ctx) == m:
            return split
    except NoRule:  # a mapping widened from a refusal
        pass
    more = tuple((p, a) for p, a in enumerate(m.ins) if a is not None)
    split = _reach(eqn, side, axis, m.ctx, more)
    if _through(eqn, split, side, axis, m.ctx) != m:
        raise NoRule("while: the loop does not settle on the widened split axis")
    return split


def _shares_of(carried: Any) -> frozenset[int]:
    return frozenset(carried[0]) if carried is not None else frozenset()


def _shares(eqn: JaxprEqn, m: Mapping) -> frozenset[int]:
    """Positions of the carries the body of a loop mapped as ``m`` sums over the axis into."""
    return _summed(_split_of(m, eqn))


def _summed(split: _Split) -> frozenset[int]:
    """Positions of the carries the body of ``split`` sums over the axis into."""
    return frozenset(split.body_got.result_shares(split.body.jaxpr))


def _side_of(m: Mapping) -> Side:
    for kind, axes in (("in", m.ins), ("out", m.outs)):
        for k, a in enumerate(axes):
            if a is not None:
                return kind, k
    raise NoRule("the split axis passes through no operand or result")


def _rebind_while(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """The loop on the chunk: its body and cond re-traced at chunk shape (the chunk's start
    enters each as one more constant)."""
    split = _split_of(m, eqn)
    c, b, _ = _counts(eqn)
    body_avals = [v.aval for v in split.body.jaxpr.invars]
    cond_avals = [v.aval for v in split.cond.jaxpr.invars]
    body = loop_body.chunk_body(split.body, split.body_got, n, body_avals)
    cond = loop_body.chunk_body(split.cond, split.cond_got, n, cond_avals)
    s = jnp.asarray(start, jnp.int32)
    operands = [s, *invals[:c], s, *invals[c : c + b], *invals[c + b :]]
    return bind_eqn_with(
        eqn, operands, cond_jaxpr=cond, body_jaxpr=body, cond_nconsts=c + 1, body_nconsts=b + 1
    )


split_rule("while", rebind=_rebind_while, running=(Same(),), widen=_widen)(_while)
