"""The splitting pass: run regions around too-large values in sequential chunks.

For each intermediate larger than a share of the temporary budget (largest first), every axis is
tried: the region that axis allows is grown (memsafe.split.region), its chunk chosen from the
budget (memsafe.split.size), and the option with the fewest loop iterations is emitted
(memsafe.split.emit). Staged regions with the max-shifted exp-sum structure run as one online loop
(memsafe.split.online). Values no axis can split are reported as blockers naming the operation that
stopped each axis.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

from memsafe._jax import (
    CALL_PRIMITIVES,
    LOOP_BODIES,
    ClosedJaxpr,
    JaxprEqn,
    Var,
    bind_eqn_with,
    call_again,
    inner_jaxpr,
    nbytes_of_aval,
    programs,
    source_line,
)
from memsafe.errors import Blocker
from memsafe.graph import Graph, estimate
from memsafe.graph.interpret import evaluate, inline_calls, retrace
from memsafe.passes import recompute as recompute_pass
from memsafe.passes.base import PassContext
from memsafe.plan import SplitRecord
from memsafe.primitives import FUSIBLE
from memsafe.split import halo, online, recompute, replay
from memsafe.split.emit import Split, StagedSplit, emit, tiled_selection, unwrapped
from memsafe.split.region import Region, SplitFailure, grow
from memsafe.split.registry import PLAIN, NoRule, RuleContext, axis_map
from memsafe.split.size import ChunkPlan, choose_chunk, smallest_chunk, speed_cap, two_chunks

#: A value is split when it exceeds this share of the temporary budget.
SHARE = 4
#: Where no value exceeds budget / SHARE, values over budget / MANY_SHARE are split.
MANY_SHARE = 16
#: Values up to budget / SMALL may stay whole outside a region.
SMALL = 8
#: Most regions one run of the pass emits.
MAX_REGIONS = 16
#: Axes whose loop counts are within this factor of the fewest count as equally cheap; among
#: them a plain split beats an online-softmax one, then the thickest slab wins. A 67-row slab of
#: a 10k x 1M kNN ran 1.7x slower than a 6,850-column one with nearly the same loop count (150
#: vs 146): a thin side starves the GEMM and multiplies per-row calls.
SIMILAR_COST = 1.25


def _describe(graph: Graph, var: Var) -> str:
    info = graph.info(var)
    eqn = graph.eqns[info.producer] if info.producer is not None else None
    what = f"{info.dtype}{list(info.shape)}"
    if eqn is None:
        return what
    where = source_line(eqn)
    return f"{what} ({eqn.primitive.name}{' at ' + where if where else ''})"


def _floor(ctx: PassContext) -> int:
    """The budget a floored chunk is sized from (:func:`smallest_chunk`): the budget, on a
    first attempt or a grown one; once the driver shrinks the chunks, the budget scaled again
    (the chunk scale squared), so that the last attempts reach the sinks' smallest chunks
    before a refusal."""
    return int(ctx.temp_budget * min(1.0, ctx.chunk_scale))


def _floor_blocker(graph: Graph, var: Var, axis: int, chunk: ChunkPlan) -> Blocker:
    """Why a split at a floored chunk (:func:`smallest_chunk`) may still not fit (reported only
    if no attempt fits: the last attempts floor at the sinks' smallest chunk)."""
    info = graph.info(var)
    return Blocker(
        value=_describe(graph, var),
        shape=info.shape,
        dtype=str(info.dtype),
        bytes=info.bytes,
        operation="split",
        reason=f"axis {axis}: the size model expects no chunk to fit, and chunks of "
        f"{chunk.chunk} left too little room for the rest of the program",
        inherent=True,
    )


def _key(graph: Graph, var: Var) -> tuple:
    info = graph.info(var)
    eqn = graph.eqns[info.producer]
    return (eqn.primitive.name, info.shape, str(info.dtype), source_line(eqn))


def candidates(graph: Graph, budget: int, limit: int | None = None) -> list[Var]:
    """Intermediates over ``budget / SHARE`` bytes, largest first. Where none is, but the
    program is still estimated over ``limit`` (many moderate values alive at once, as in a deep
    network's backward pass), those over ``budget / MANY_SHARE``."""
    values = [
        vi
        for vi in graph.values()
        if vi.producer is not None and not vi.is_output and vi.consumers  # dead: XLA drops it
    ]
    out = [vi for vi in values if vi.bytes > budget // SHARE]
    if not out and limit is not None and estimate(graph).peak_bytes > limit:
        out = [vi for vi in values if vi.bytes > budget // MANY_SHARE]
    out.sort(key=lambda vi: (-vi.bytes, vi.producer))
    return [vi.var for vi in out]


def strategy(graph: Graph, region: Region) -> Split:
    """How ``region`` runs: staged max-shifted exp-sums as one online loop where that applies,
    else one loop per stage (computing the values its later loops recompute and compare the
    same way in every loop, :mod:`memsafe.split.recompute`)."""
    if not region.windowed:  # extended chunks run as plain staged loops (memsafe.split.halo)
        try:
            return online.plan(graph, region)
        except online.NotOnline:
            pass
    if not recompute.decides_on_recomputed(graph, region):
        return StagedSplit(region)
    return StagedSplit(region, same=True, pinned=recompute.pinned(graph, region))


def _option(
    graph: Graph,
    var: Var,
    axis: int,
    budget: int,
    mesh: Any = None,
    floor: int = 0,
    ctx: RuleContext = PLAIN,
) -> tuple[Split, ChunkPlan]:
    """The split of ``var`` along ``axis`` (sharded over ``mesh``'s devices where given) and
    its chunk (``floor``: see :func:`smallest_chunk`); raises SplitFailure. Where the program
    has windowed operations, the region on extended chunks comes first (:func:`_region`)."""
    region = _region(graph, var, axis, budget, ctx, windowed=mesh is None)
    split = strategy(graph, region)
    if mesh is not None:
        split = mesh.shard(graph, split)
    chunk = choose_chunk(graph, split, budget) or smallest_chunk(graph, split, floor)
    if chunk.loops * chunk.devices < 2:
        chunk = two_chunks(graph, split, chunk)
        if chunk is None:
            raise SplitFailure("the axis is too short to split", inherent=True)
    return split, chunk


def _region(
    graph: Graph, var: Var, axis: int, budget: int, ctx: RuleContext, windowed: bool
) -> Region:
    """The region splitting ``var`` along ``axis``. Where ``windowed`` and the program has
    windowed operations (convolutions), first the region on extended chunks
    (:mod:`memsafe.split.halo`), which runs several of them in a row in one loop; the plain
    region where that fails or needs no extension."""
    small, large = max(1, budget // SMALL), max(1, budget // 2)
    if windowed and any(e.primitive.name in halo.WINDOWED for e in graph.eqns):
        try:
            region = grow(graph, var, axis, small, large, replace(ctx, extended=True))
        except SplitFailure:
            region = None
        if region is not None and region.windowed:
            return region
    return grow(graph, var, axis, small, large, ctx)


def best_split(
    graph: Graph, var: Var, budget: int, mesh: Any = None, floor: int = 0
) -> tuple[Split, ChunkPlan] | list[tuple[int, SplitFailure]]:
    """:func:`cheapest_split`; where no axis splits, the same with loops replayed per chunk of
    an accumulator (:mod:`memsafe.split.replay`: their work once per chunk), and the first
    failures where that finds none either."""
    got = cheapest_split(graph, var, budget, mesh, floor)
    if not isinstance(got, list) or not any(
        e.primitive.name in replay.REPLAYABLE for e in graph.eqns
    ):
        return got
    replaying = RuleContext(replaying=True)
    replayed = cheapest_split(graph, var, budget, mesh, floor, replaying)
    return got if isinstance(replayed, list) else replayed


def cheapest_split(
    graph: Graph,
    var: Var,
    budget: int,
    mesh: Any = None,
    floor: int = 0,
    ctx: RuleContext = PLAIN,
) -> tuple[Split, ChunkPlan] | list[tuple[int, SplitFailure]]:
    """The cheapest way to split ``var`` (fewest loop iterations; chunks the model expects to fit
    before the fallbacks: the smallest chunks of axes where none does, two chunks of axes it
    expects to fit whole), or why each axis failed. Among smallest chunks, those whose own
    bytes fit the budget come first: what the model holds beside them may be alive anyway,
    while a chunk over the budget by itself cannot fit (a transformer block's backward at
    L=8192: one head's scores, 813 MiB, against a query chunk's 0.4 MiB)."""
    options: list[tuple[Split, ChunkPlan]] = []
    failures: list[tuple[int, SplitFailure]] = []
    for axis, n in enumerate(graph.info(var).shape):
        if n < 2:
            continue
        try:
            options.append(_option(graph, var, axis, budget, mesh, floor, ctx))
        except SplitFailure as failure:
            failures.append((axis, failure))
    if not options:
        return failures
    options = (
        [o for o in options if not (o[1].floored or o[1].halved)]
        or [o for o in options if o[1].per_unit * o[1].chunk <= budget]
        or options
    )
    fewest = min(_cost(*o) for o in options)
    close = [o for o in options if _cost(*o) <= SIMILAR_COST * fewest]
    return min(
        close,
        key=lambda o: (
            not isinstance(o[0], StagedSplit),
            -o[1].chunk,
            _cost(*o),
            o[0].region.seed_axis,
        ),
    )


def _cost(split: Split, chunk: ChunkPlan) -> float:
    """Loop iterations, weighted by the strategy (an online loop rescales its accumulators)."""
    return chunk.iterations * split.cost_weight


def absorbed(graph: Graph, region: Region, var: Var, budget: int) -> list[Var]:
    """Other too-large values the region computes chunk by chunk (work shared with ``var``'s loop:
    values reading the same sliced inputs join it by forward propagation)."""
    return [
        v
        for v in candidates(graph, budget)
        if v is not var
        and v in region.produced
        and graph.eqns[graph.info(v).producer].primitive.name not in FUSIBLE
    ]


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Split every too-large intermediate that some axis allows, at the top level and inside
    loop bodies; block the rest."""
    closed = _unheld_inside(closed, ctx, ctx.temp_budget, takes=_held_whole)
    return _split_bodies(*_split_top(closed, ctx), ctx)


def _held_whole(eqn: JaxprEqn, position: int) -> bool:
    """Whether no axis of a loop's operand at ``position`` passes through the loop: a split at
    the top level cannot slice it per chunk (a Sinkhorn loop's cost matrix, reduced along both
    axes in its body), so it is made inside the loop before the top level is split."""
    var = eqn.invars[position]
    for axis in range(len(var.aval.shape)):
        try:
            axis_map(eqn, ("in", position), axis, PLAIN)
        except NoRule:
            continue
        return False
    return True


def _bodies(eqn: JaxprEqn) -> tuple[ClosedJaxpr, ...]:
    """The programs a loop, cond or call (a chunk body under ``jax.checkpoint``) runs; none
    for other equations."""
    if eqn.primitive.name in LOOP_BODIES:
        return programs(eqn)
    sub = inner_jaxpr(eqn) if eqn.primitive.name in CALL_PRIMITIVES else None
    return () if sub is None else (sub,)


def _largest_inside(eqn: JaxprEqn) -> int:
    """Bytes of the largest value the programs ``eqn`` runs make (a loop's or cond's: its own
    and those of loops replayed per chunk within them; a call's: those of such loops only). A
    replayed loop makes its term whole in each iteration, wherever it sits: in a chunk loop's
    body, or in its first or last chunk, a call under ``jax.checkpoint``."""
    own = eqn.primitive.name in LOOP_BODIES
    return max((_largest_made(b.jaxpr, own) for b in _bodies(eqn)), default=0)


@functools.lru_cache(maxsize=256)
def _largest_made(jaxpr: Any, own: bool) -> int:
    """Bytes of the largest value ``jaxpr``'s equations make (with ``own``; not those in the
    calls among them) and the loops replayed per chunk in it make, calls looked through."""
    largest = 0
    for eqn in jaxpr.eqns:
        if own:
            largest = max([largest, *(nbytes_of_aval(v.aval) for v in eqn.outvars)])
        if eqn.primitive.name in LOOP_BODIES:
            replayed = (b for b in programs(eqn) if replay.made(b))
            largest = max([largest, *(_largest_made(b.jaxpr, True) for b in replayed)])
        elif sub := _bodies(eqn):  # a chunk body: what its split sized, but for replays
            largest = max(largest, _largest_made(sub[0].jaxpr, False))
    return largest


def _split_bodies(
    closed: ClosedJaxpr, kept: dict[int, ClosedJaxpr], ctx: PassContext
) -> ClosedJaxpr:
    """Loops whose body makes a too-large value get their body split, under the budget left once
    the loop's operands and results are placed (each iteration runs the split body); a cond's
    branches likewise, and the loops replayed per chunk in a call (a chunk loop's first or last
    chunk, run under ``jax.checkpoint`` beside the loop). Loops whose bodies are in ``kept``
    stay as they are."""
    closed = _invariants_inside(closed, kept, ctx)
    graph = Graph(closed)
    budget = ctx.temp_budget
    targets = {
        i
        for i, e in enumerate(graph.eqns)
        if _bodies(e) and _largest_inside(e) > budget // SHARE and not _is_kept(e, kept)
    }
    if not targets:
        return closed

    def override(i: int, eqn: Any, invals: list[Any]) -> list[Any] | None:
        if i not in targets:
            return None
        sub = PassContext(
            ctx.memory_limit, ctx.fixed_bytes + _live(graph, eqn), ctx.plan, ctx.chunk_scale
        )
        if eqn.primitive.name not in LOOP_BODIES:  # the replayed loops in a call
            inner = _split_bodies(inline_calls(_bodies(eqn)[0]), kept, sub)
            _block_all(ctx, sub)
            return call_again(eqn, invals, lambda *ops: evaluate(inner, list(ops)))
        split = tuple(run(inline_calls(b), sub) for b in _bodies(eqn))
        _block_all(ctx, sub)
        key = LOOP_BODIES[eqn.primitive.name]
        held = split if isinstance(eqn.params[key], tuple) else split[0]
        return bind_eqn_with(eqn, invals, **{key: held})

    return retrace(closed, override)


def _block_all(ctx: PassContext, sub: PassContext) -> None:
    """Report in ``ctx`` what blocked splits in ``sub``."""
    for blocker in sub.blockers:
        ctx.block(blocker)


def _is_kept(eqn: Any, kept: dict[int, ClosedJaxpr]) -> bool:
    """Whether a loop's (cond's, call's) bodies are among ``kept``, not to be touched again."""
    return any(id(b.jaxpr) in kept for b in _bodies(eqn))


def _invariants_inside(
    closed: ClosedJaxpr, kept: dict[int, ClosedJaxpr], ctx: PassContext
) -> ClosedJaxpr:
    """``closed`` with the loop invariants too large for the budget made inside the loops that
    read them (the recompute pass's move, for cheap generators: a causal mask broadcast to
    ``[batch, heads, L, L]``), so that splitting a body chunks them with the rest; held
    outside, they stay whole beside the split body. Done after the top-level split, which may
    slice them per chunk instead; kept loops stay as they are. Then :func:`_unheld_inside`."""
    floor = max(recompute_pass.MIN_BYTES, ctx.temp_budget // SHARE)
    skip = lambda e: _is_kept(e, kept)
    closed = recompute_pass.run(closed, ctx, recompute_pass.Moving(floor, skip=skip))
    return _unheld_inside(closed, ctx, skip=skip)


def _unheld_inside(
    closed: ClosedJaxpr, ctx: PassContext, room: int | None = None, **which: Any
) -> ClosedJaxpr:
    """``closed`` with the loop invariants larger than all the room for temporaries (those the
    ``skip``/``takes`` of ``which`` choose, :class:`memsafe.passes.recompute.Moving`) made inside
    the loops that read them, their reductions and products included (a Sinkhorn loop's cost
    matrix); ``while`` loops too, since XLA hoists nothing out of a split body's chunk loops.
    One the room could hold stays outside: made inside, its computation would have to split
    within the body (fuzz seed 1389 was refused so). ``room``: that room (None: all of it; the
    invariants a loop holds whole are measured against the scaled budget, so that an attempt
    after one that failed moves a matrix the room held but not beside the rest: a Sinkhorn
    loop's cost matrix, read again by the gradient of the transport cost)."""
    floor = max(recompute_pass.MIN_BYTES, ctx.room if room is None else room)
    moving = recompute_pass.Moving(floor, recompute_pass.UNHELD, whiles=True, **which)
    return recompute_pass.run(closed, ctx, moving)


def _live(graph: Graph, eqn: Any) -> int:
    """Bytes of a loop's (or cond's) operands and results beside its body, each value once; the
    program's own inputs and outputs among them are in the fixed bytes already."""
    jaxpr = graph.closed.jaxpr
    counted = {*jaxpr.invars, *(v for v in jaxpr.outvars if isinstance(v, Var))}
    values = {v for v in (*eqn.invars, *eqn.outvars) if isinstance(v, Var) and v not in counted}
    return sum(graph.info(v).bytes for v in values)


def _loop_bodies(closed: ClosedJaxpr) -> dict[int, ClosedJaxpr]:
    """Each loop body, cond branch and call body at the top level of ``closed``, by the ``id``
    of its jaxpr (a call's is wrapped anew each time it is asked for)."""
    return {id(b.jaxpr): b for e in closed.jaxpr.eqns for b in _bodies(e)}


def _split_top(closed: ClosedJaxpr, ctx: PassContext) -> tuple[ClosedJaxpr, dict[int, ClosedJaxpr]]:
    """Split every too-large intermediate of the program's top level that some axis allows;
    returns the program and the loop bodies not to split again (by ``id``, held so that no
    other object takes the ``id``): those of staged splits whose later loops compare values
    they recompute, which every loop must compute alike (split again, one body could sum in
    another order than the other)."""
    failed: set[tuple] = set()
    kept: dict[int, ClosedJaxpr] = {}
    for _ in range(MAX_REGIONS):
        graph = Graph(closed)
        budget = ctx.temp_budget
        chosen = None
        for var in candidates(graph, budget, ctx.memory_limit):
            if _key(graph, var) in failed:
                continue
            got = best_split(graph, var, budget, ctx.mesh, _floor(ctx))
            if isinstance(got, tuple):
                chosen = (var, *got, absorbed(graph, got[0].region, var, budget))
                break
            failed.add(_key(graph, var))
            info = graph.info(var)
            for axis, failure in got:
                ctx.block(
                    Blocker(
                        value=_describe(graph, var),
                        shape=info.shape,
                        dtype=str(info.dtype),
                        bytes=info.bytes,
                        operation=failure.operation,
                        reason=f"axis {axis}: {failure.reason}",
                        where=failure.where,
                        inherent=failure.inherent,
                    )
                )
        if chosen is None:
            return closed, kept
        var, split, chunk, merged = chosen
        region = split.region
        chunk = speed_cap(graph, region, chunk)
        if chunk.floored:
            ctx.block(_floor_blocker(graph, var, region.seed_axis, chunk))
        new = emit(closed, graph, split, chunk.chunk)
        inner = unwrapped(split)
        if isinstance(inner, StagedSplit) and inner.same:
            old = _loop_bodies(closed)
            kept |= {k: b for k, b in _loop_bodies(new).items() if k not in old}
        eqns = graph.eqns
        sinks = sorted({m.kind for m in region.sinks.values()})
        if any(graph.info(v).is_output for v in region.surviving):
            sinks.append("output")
        if split.label is not None:
            sinks.append(split.label)
        tiled = tiled_selection(graph, split, chunk.chunk)
        if tiled is not None:
            sinks.append(tiled.describe())
        ctx.record(
            SplitRecord(
                value=" + ".join(_describe(graph, v) for v in [var, *merged]),
                bytes=sum(graph.info(v).bytes for v in [var, *merged]),
                axis=region.seed_axis,
                size=region.size,
                chunk=chunk.chunk if tiled is None else tiled.step,
                loops=chunk.iterations if tiled is None else tiled.loops,
                devices=chunk.devices,
                share=chunk.share,
                mesh_axes=split.mesh_axes,
                batch_mesh_axes=getattr(split, "batch_mesh_axes", ()),
                floored=chunk.floored,
                ops=tuple(sorted({eqns[i].primitive.name for i in region.maps})),
                sinks=tuple(sinks),
                where=source_line(eqns[graph.info(var).producer]),
                **recompute.cost(graph, split, chunk.chunk),
            )
        )
        closed = new
    return closed, kept
