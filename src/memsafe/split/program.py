"""Splitting a whole program: its top level value by value, then the programs its loops run.

The top level is split region by region (:func:`split_program`): each time, the first too-large
value that some axis splits (:func:`memsafe.split.planner.best_split`) is emitted as chunk loops
(:mod:`memsafe.split.emit`) and recorded; values no axis can split are reported as blockers naming
the operation that stopped each axis. Then each loop, cond or call whose programs make a too-large
value has them split in turn, under the budget left beside the loop. Loop invariants too large to
hold are first moved into the loops that read them (:mod:`memsafe.rewrite.invariants`).
"""

from __future__ import annotations

import functools
from typing import Any

from memsafe import policy
from memsafe._jax import (
    CUSTOM_DIFF_PRIMITIVES,
    LOOP_BODIES,
    ClosedJaxpr,
    JaxprEqn,
    Var,
    inner_jaxpr,
    nbytes_of_aval,
    programs,
    source_line,
)
from memsafe.context import PassContext
from memsafe.errors import Blocker
from memsafe.graph import Graph
from memsafe.graph.bodies import bodies, with_bodies
from memsafe.graph.interpret import inline_calls, retrace
from memsafe.plan import PassRecord, SplitRecord
from memsafe.rewrite import invariants
from memsafe.split.body import makes_whole, mark_makes_whole
from memsafe.split.emit import Split, emit, unwrapped
from memsafe.split.planner import absorbed, best_split, candidates
from memsafe.split.region import Region
from memsafe.split.registry import PLAIN, NoRule, axis_map
from memsafe.split.size import ChunkPlan, speed_cap
from memsafe.split.strategies import recompute
from memsafe.split.strategies.staged import StagedSplit, planned_loop


def _describe(graph: Graph, var: Var) -> str:
    info = graph.info(var)
    eqn = graph.eqns[info.producer] if info.producer is not None else None
    what = f"{info.dtype}{list(info.shape)}"
    if eqn is None:
        return what
    where = source_line(eqn)
    return f"{what} ({eqn.primitive.name}{' at ' + where if where else ''})"


def _floor(ctx: PassContext) -> int:
    """The budget a floored chunk is sized from (:func:`memsafe.split.size.smallest_chunk`):
    the budget, on a first attempt or a grown one; once the driver shrinks the chunks, the budget
    scaled again (the chunk scale squared), so that the last attempts reach the sinks' smallest
    chunks before a refusal."""
    return int(ctx.temp_budget * min(1.0, ctx.chunk_scale))


def _floor_blocker(graph: Graph, var: Var, axis: int, chunk: ChunkPlan) -> Blocker:
    """Why a split at a floored chunk (:func:`memsafe.split.size.smallest_chunk`) may still not
    fit (reported only if no attempt fits: the last attempts floor at the sinks' smallest
    chunk)."""
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


def split_program(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Split every too-large intermediate that some axis allows, at the top level and inside
    the programs loops run.

    Args:
        closed: the program, calls inlined.
        ctx: the budget; each split is recorded in ``ctx.plan``, and what no axis splits is
            reported with ``ctx.block``.

    Returns:
        The program with its splits emitted as chunk loops.
    """
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


def _largest_inside(eqn: JaxprEqn) -> int:
    """Bytes of the largest value the programs ``eqn`` runs make (a loop's or cond's: its own
    and those of loops replayed per chunk within them; a call's: those of such loops only). A
    replayed loop makes its term whole in each iteration, wherever it sits: in a chunk loop's
    body, or in its first or last chunk, a call under ``jax.checkpoint``."""
    own = eqn.primitive.name in LOOP_BODIES
    return max((_largest_made(b.jaxpr, own or makes_whole(b)) for b in bodies(eqn)), default=0)


@functools.lru_cache(maxsize=256)
def _largest_made(jaxpr: Any, own: bool) -> int:
    """Bytes of the largest value ``jaxpr``'s equations make (with ``own``; not those in the
    calls among them) and the loops replayed per chunk in it make, calls looked through. With
    ``own`` (a loop's body, split as a program of its own: its loops are split in turn) the
    loops nested in it and its custom-derivative calls count whole: a Sinkhorn solver's cost
    matrix is made in the ``scan`` of inner iterations inside its ``while`` loop."""
    largest = 0
    for eqn in jaxpr.eqns:
        if own:
            largest = max([largest, *(nbytes_of_aval(v.aval) for v in eqn.outvars)])
        if eqn.primitive.name in LOOP_BODIES:
            nested = [b for b in programs(eqn) if own or makes_whole(b)]
            largest = max([largest, *(_largest_made(b.jaxpr, True) for b in nested)])
        elif own and eqn.primitive.name in CUSTOM_DIFF_PRIMITIVES:
            inner = inner_jaxpr(eqn)
            largest = max(largest, 0 if inner is None else _largest_made(inner.jaxpr, True))
        elif sub := bodies(eqn):  # a chunk body: what its split sized, but for replays
            largest = max(largest, _largest_made(sub[0].jaxpr, makes_whole(sub[0])))
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
        if bodies(e) and _largest_inside(e) > budget // policy.SPLIT.share and not _is_kept(e, kept)
    }
    if not targets:
        return closed

    def override(i: int, eqn: Any, invals: list[Any]) -> list[Any] | None:
        if i not in targets:
            return None
        sub = PassContext(
            ctx.memory_limit,
            ctx.fixed_bytes + _live(graph, eqn),
            ctx.plan,
            ctx.chunk_scale,
            floored_held=ctx.floored_held,
            held=ctx.held,
        )
        if eqn.primitive.name in LOOP_BODIES or any(makes_whole(b) for b in bodies(eqn)):
            out = with_bodies(eqn, invals, lambda b: split_program(inline_calls(b), sub))
        else:  # the replayed loops in a call
            out = with_bodies(eqn, invals, lambda b: _split_bodies(inline_calls(b), kept, sub))
        _block_all(ctx, sub)
        return out

    return retrace(closed, override)


def _block_all(ctx: PassContext, sub: PassContext) -> None:
    """Report in ``ctx`` what blocked splits in ``sub`` (and whether it took held splits or
    declined floored ones)."""
    for blocker in sub.blockers:
        ctx.block(blocker)
    ctx.held_taken |= sub.held_taken
    ctx.held_declined |= sub.held_declined


def _is_kept(eqn: Any, kept: dict[int, ClosedJaxpr]) -> bool:
    """Whether a loop's (cond's, call's) bodies are among ``kept``, not to be touched again."""
    return any(id(b.jaxpr) in kept for b in bodies(eqn))


def _invariants_inside(
    closed: ClosedJaxpr, kept: dict[int, ClosedJaxpr], ctx: PassContext
) -> ClosedJaxpr:
    """``closed`` with the loop invariants too large for the budget made inside the loops that
    read them (the recompute pass's move, for cheap generators: a causal mask broadcast to
    ``[batch, heads, L, L]``), so that splitting a body chunks them with the rest; held
    outside, they stay whole beside the split body. Done after the top-level split, which may
    slice them per chunk instead; kept loops stay as they are. Then :func:`_unheld_inside`."""
    floor = max(policy.REWRITE.invariant_floor(ctx.room), ctx.temp_budget // policy.SPLIT.share)
    skip = lambda e: _is_kept(e, kept)
    closed = _moved(closed, ctx, invariants.Moving(floor, skip=skip))
    return _unheld_inside(closed, ctx, skip=skip)


def _unheld_inside(
    closed: ClosedJaxpr, ctx: PassContext, room: int | None = None, **which: Any
) -> ClosedJaxpr:
    """``closed`` with the loop invariants larger than all the room for temporaries (those the
    ``skip``/``takes`` of ``which`` choose, :class:`memsafe.rewrite.invariants.Moving`) made inside
    the loops that read them, their reductions and products included (a Sinkhorn loop's cost
    matrix); ``while`` loops too, since XLA hoists nothing out of a split body's chunk loops;
    and the branches of ``cond``s that read them (a Sinkhorn body's convergence test every few
    iterations, reducing the cost matrix in a branch: the branch is then split as a program of
    its own, its reductions chunk by chunk, its index whole).
    One the room could hold stays outside: made inside, its computation would have to split
    within the body (fuzz seed 1389 was refused so). ``room``: that room (None: all of it; the
    invariants a loop holds whole are measured against the scaled budget, so that an attempt
    after one that failed moves a matrix the room held but not beside the rest: a Sinkhorn
    loop's cost matrix, read again by the gradient of the transport cost)."""
    floor = max(policy.REWRITE.invariant_min_bytes, ctx.room if room is None else room)
    moving = invariants.Moving(floor, invariants.UNHELD, whiles=True, conds=True, **which)
    return _moved(closed, ctx, moving)


def _moved(closed: ClosedJaxpr, ctx: PassContext, moving: invariants.Moving) -> ClosedJaxpr:
    """``closed`` with the loop invariants ``moving`` selects made inside the loops that read
    them, each move recorded in ``ctx`` (as the recompute pass records its own)."""
    records: list[PassRecord] = []
    new = invariants.transform(closed, records, moving=moving)
    for rec in records:
        ctx.record(rec)
    return new


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
    return {id(b.jaxpr): b for e in closed.jaxpr.eqns for b in bodies(e)}


def _split_top(closed: ClosedJaxpr, ctx: PassContext) -> tuple[ClosedJaxpr, dict[int, ClosedJaxpr]]:
    """Split every too-large intermediate of the program's top level that some axis allows;
    returns the program and the loop bodies not to split again (by ``id``, held so that no
    other object takes the ``id``): those of staged splits whose later loops compare values
    they recompute, which every loop must compute alike (split again, one body could sum in
    another order than the other)."""
    failed: set[tuple] = set()
    kept: dict[int, ClosedJaxpr] = {}
    for _ in range(policy.SPLIT.max_regions):
        graph = Graph(closed)
        chosen = _chosen(graph, ctx, failed)
        if chosen is None:
            return closed, kept
        var, split, chunk, merged = chosen
        chunk = speed_cap(graph, split.region, chunk)
        if chunk.floored:
            ctx.block(_floor_blocker(graph, var, split.region.seed_axis, chunk))
        new = emit(closed, graph, split, chunk.chunk)
        if chunk.floored and chunk.per_unit > ctx.room:
            _mark_chunk_bodies(closed, new)
        inner = unwrapped(split)
        if isinstance(inner, StagedSplit) and inner.same:
            old = _loop_bodies(closed)
            kept |= {k: b for k, b in _loop_bodies(new).items() if k not in old}
        ctx.record(_record(graph, split, chunk, [var, *merged], ctx.room))
        closed = new
    return closed, kept


def _mark_chunk_bodies(old: ClosedJaxpr, new: ClosedJaxpr) -> None:
    """Mark the chunk bodies a split at a floored chunk emitted (the calls under
    ``jax.checkpoint`` in its chunk loops' bodies, and its first or last chunk beside them) as
    making values whole (:func:`memsafe.split.body.mark_makes_whole`), where the size model
    expects one position of the axis to take more than all the room: each is split again as a
    program of its own (a batch of transport problems taken one by one, each problem's cost
    matrix still too large to hold: it is made inside the problem's solver loop, in chunks).
    Chunks over the scaled budget only are left whole: splitting their small values again adds
    loops and their carries (fuzz seed 7374, a top_k over rows of 8 x 2, went over its limit
    so; a layer stack's gradient, floored at 19 rows of 8 KiB, took 7% more)."""
    before = _loop_bodies(old)
    for eqn in new.jaxpr.eqns:
        for body in bodies(eqn):
            if id(body.jaxpr) in before:
                continue
            if eqn.primitive.name not in LOOP_BODIES:  # a first or last chunk
                mark_makes_whole(body)
                continue
            for inner in body.jaxpr.eqns:  # a chunk loop: its chunk body
                if inner.primitive.name not in LOOP_BODIES:
                    for chunk_body in bodies(inner):
                        mark_makes_whole(chunk_body)


def _chosen(
    graph: Graph, ctx: PassContext, failed: set[tuple]
) -> tuple[Var, Split, ChunkPlan, list[Var]] | None:
    """The first candidate (:func:`memsafe.split.planner.candidates`) that some axis splits: the
    value, its split and chunk, and the other too-large values its region computes; None where
    none is. Candidates no axis splits are blocked in ``ctx`` and added to ``failed`` (by
    :func:`_key`), not to be tried again."""
    budget = ctx.temp_budget
    for var in candidates(graph, budget, ctx.memory_limit):
        if _key(graph, var) in failed:
            continue
        room = ctx.room if ctx.held else 0
        got = best_split(
            graph, var, budget, ctx.mesh, _floor(ctx), room, ctx.floored_held, ctx.decline_held
        )
        if isinstance(got, tuple):
            ctx.held_taken |= got[1].held
            return (var, *got, absorbed(graph, got[0].region, var, budget))
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
    return None


def _carried_sinks(graph: Graph, region: Region) -> set[str]:
    """Kinds of the equations that consume the axis into a value carried from chunk to chunk
    (a combining scatter into its running result, :meth:`Running.sink`), named as sinks."""
    kinds = set()
    for i in region.maps:
        run = region.running(graph, i)
        sink = None if run is None else run.sink(graph.eqns[i], region.maps[i])
        if sink is not None:
            kinds.add(sink.kind)
    return kinds


def _record(
    graph: Graph, split: Split, chunk: ChunkPlan, values: list[Var], room: int
) -> SplitRecord:
    """What the plan says of ``split`` at ``chunk``, splitting ``values`` (the candidate first,
    then those its region absorbed), sized in ``room`` (unscaled, ``PassContext.room``)."""
    region, eqns = split.region, graph.eqns
    sinks = sorted({m.kind for m in region.sinks.values()} | _carried_sinks(graph, region))
    if any(graph.info(v).is_output for v in region.surviving):
        sinks.append("output")
    if split.label is not None:
        sinks.append(split.label)
    tiled = planned_loop(graph, split, chunk.chunk)
    if tiled is not None:
        sinks.append(tiled.describe())
    return SplitRecord(
        value=" + ".join(_describe(graph, v) for v in values),
        bytes=sum(graph.info(v).bytes for v in values),
        axis=region.seed_axis,
        size=region.size,
        chunk=chunk.chunk if tiled is None else tiled.step,
        loops=chunk.iterations if tiled is None else tiled.loops,
        devices=chunk.devices,
        share=chunk.share,
        # a sharded split's mesh axes (memsafe.split.strategies.sharded); none on one device
        mesh_axes=getattr(split, "mesh_axes", ()),
        batch_mesh_axes=getattr(split, "batch_mesh_axes", ()),
        floored=chunk.floored,
        per_unit=chunk.per_unit,
        fixed=chunk.fixed,
        room=room,
        ops=tuple(sorted({eqns[i].primitive.name for i in region.maps})),
        sinks=tuple(sinks),
        where=source_line(eqns[graph.info(values[0]).producer]),
        **recompute.cost(graph, split, chunk.chunk),
    )
