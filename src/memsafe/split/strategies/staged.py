"""Staged splits: a region run as one loop per stage (memsafe.split.loop drives each), each
recomputing what it needs from the leaves; every region may run so. A loop may run another way
than chunk by chunk: the split's loop strategies (``memsafe.split.emit.LoopStrategy``, the
planner's ``LOOPS``; memsafe.split.strategies.selection's ``top_k`` in tiles) are asked first.
What the later loops recompute, and how they compare recomputed values alike, is
memsafe.split.strategies.recompute.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
from jax import lax

from memsafe._jax import JaxprEqn, Literal
from memsafe.graph import Graph
from memsafe.graph.interpret import Group, evaluate_eqns
from memsafe.split import loop as chunk_loop
from memsafe.split import peephole
from memsafe.split.emit import Loop, LoopPlan, LoopStrategy, OneDevice, Split, plan_loops, unwrapped
from memsafe.split.loop import ChunkEnv, DevicesRunner, Fold, Written
from memsafe.split.region import Region
from memsafe.split.sinks import Sink


def _loop_plan(
    graph: Graph,
    region: Region,
    loop: Loop,
    chunk: int,
    devices: int,
    strategies: tuple[LoopStrategy, ...],
) -> LoopPlan | None:
    """The first of ``strategies`` that plans ``loop``, or None."""
    for strategy in strategies:
        planned = strategy(graph, region, loop, chunk, devices)
        if planned is not None:
            return planned
    return None


def planned_loop(graph: Graph, split: Split, chunk: int) -> LoopPlan | None:
    """The loop of ``split`` a loop strategy runs (memsafe.split.strategies.selection's ``top_k`` in
    tiles), if any: a staged split, on one device or sharded over a mesh
    (memsafe.split.strategies.sharded.mesh)."""
    inner = unwrapped(split)
    if not isinstance(inner, StagedSplit) or inner.same:
        return None
    for lp in plan_loops(graph, split.region):
        planned = _loop_plan(graph, split.region, lp, chunk, split.devices, inner.loop_strategies)
        if planned is not None:
            return planned
    return None


def _loop_group(
    graph: Graph,
    region: Region,
    loop: Loop,
    chunk: int,
    dead: frozenset[int],
    runner: chunk_loop.Runner,
    same: bool = False,
    pinned: frozenset[int] = frozenset(),
    strategies: tuple[LoopStrategy, ...] = (),
):
    """One stage as a group of the interpreter: its loop over every chunk, run by ``runner``,
    or as the first of ``strategies`` that applies runs it. With ``same``, the values are
    computed as in every other loop of the region (no peephole moves, no loop strategies), and
    the results of the equations in ``pinned`` held behind a barrier (:meth:`ChunkEnv.pinned`)."""
    sharded = isinstance(runner, DevicesRunner)
    plain = region.span.plain  # peephole moves and loop strategies assume a chunk is its own
    other = (runner is chunk_loop.run or sharded) and not same and plain
    devices = runner.devices if sharded else 1
    planned = _loop_plan(graph, region, loop, chunk, devices, strategies) if other else None
    if planned is not None:
        return loop.group(dead, functools.partial(planned.run, runner=runner))
    eqns = graph.eqns
    moved = loop.eqns if plain and not same else ()  # () plans none
    peep = peephole.plan(graph, region, moved, chunk)
    kept = {i: run for i in loop.eqns if (run := region.running(graph, i)) is not None}
    running = tuple(kept)
    reverse = any(run.reverse(eqns[i]) for i, run in kept.items())
    finals = tuple(
        (k, eqns[i], run, region.after_loop_positions(graph, i))
        for k, (i, run) in enumerate(kept.items())
        if i in loop.threads
    )
    carry = Fold(
        tuple((eqns[i], region.maps[i]) for i in loop.sinks), running, reverse, finals,
        tuple((eqns[i], run) for i, run in kept.items()),
    )  # fmt: skip
    written = Written.of(loop.surviving, region.axis_of, region.span.scale_of)
    n_sliced = len(loop.sliced)

    order = [  # sinks of earlier stages are read, not evaluated
        i
        for i in loop.eqns
        if i not in peep.skip and (i in loop.sinks or not isinstance(region.maps[i], Sink))
    ]

    def body(start: Any, n: int, ops: list[Any], fed: Any) -> tuple[list, list]:
        whole = dict(zip(loop.whole, ops[n_sliced:]))
        sliced = list(zip(loop.sliced, ops[:n_sliced]))
        env = ChunkEnv.slice_in(graph, region, peep, start, n, sliced, whole, fed)
        parts = []

        def bind(i: int, eqn: JaxprEqn, invals: list[Any]) -> Sequence[Any]:
            if isinstance(region.maps[i], Sink):
                parts.append(env.partial(i, invals))
                return ()  # the partial is the loop's, not a value of the chunk
            outs = env.step(i, eqn, invals)
            return env.pinned(i, outs) if i in pinned else outs

        evaluate_eqns(eqns, order, env, bind)
        return (parts, [env.carries[i] for i in running]), [env.written(v) for v in loop.surviving]

    axes = chunk_loop.operand_axes(region.axis_of, loop.sliced, loop.whole)
    fresh = _filled_in_place(graph, region, loop, running)

    def run_loop(operands: list[Any]) -> list[Any]:
        operands = _fresh_fills(graph, loop, operands, fresh)
        results, bufs = runner(body, region.size, chunk, operands, carry, written, axes)
        return results + bufs

    return loop.group(dead, run_loop)


def _filled_in_place(
    graph: Graph, region: Region, loop: Loop, running: tuple[int, ...]
) -> dict[int, Any]:
    """Operands of ``loop`` (by position, sliced then whole) that a running equation of the
    loop updates in place (the operand of a scatter carried from chunk to chunk: its first
    chunk scatters into it) and that are a scalar literal broadcast: position -> the literal's
    value. See :func:`_fresh_fills`."""
    eqns = graph.eqns
    operands = (*loop.sliced, *loop.whole)
    found: dict[int, Any] = {}
    for k, v in enumerate(operands):
        if k < len(loop.sliced):
            continue
        p = graph.info(v).producer
        if p is None or eqns[p].primitive.name != "broadcast_in_dim":
            continue
        src = eqns[p].invars[0]
        if not isinstance(src, Literal) or getattr(src.aval, "shape", None) != ():
            continue
        if any(eqns[i].invars[0] is v for i in running if eqns[i].invars):
            found[k] = src.val
    return found


def _fresh_fills(graph: Graph, loop: Loop, operands: list[Any], fresh: dict[int, Any]) -> list[Any]:
    """``operands`` with each of ``fresh`` (a scalar broadcast a running equation updates in
    place, :func:`_filled_in_place`) made anew for this loop, apart from equal fills elsewhere
    (:func:`memsafe.split.loop.apart`: else XLA merges them and copies the one buffer for
    every loop but the last)."""
    if not fresh:
        return operands
    names = (*loop.sliced, *loop.whole)
    infos = [graph.info(names[k]) for k in fresh]
    others = [o for k, o in enumerate(operands) if k not in fresh]

    def fills() -> list[Any]:
        return [
            lax.broadcast_in_dim(jax.numpy.asarray(fresh[k], i.dtype), i.shape, ())
            for k, i in zip(fresh, infos)
        ]

    out = list(operands)
    for k, value in zip(fresh, chunk_loop.apart(fills, others)):
        out[k] = value
    return out


@dataclass(frozen=True)
class StagedSplit(OneDevice):
    """A region run as one loop per stage, each recomputing what it needs from the leaves."""

    region: Region
    #: Its later loops compare values they recompute: every loop computes them the same way
    #: (no peephole moves, no tiles; :mod:`memsafe.split.strategies.recompute`).
    same: bool = False
    #: Equations whose results a comparison reads, computed alone in every loop that evaluates
    #: them (:meth:`ChunkEnv.pinned`, :func:`memsafe.split.strategies.recompute.pinned`).
    pinned: frozenset[int] = frozenset()
    #: Other ways to run a loop than chunk by chunk, tried in order for each loop at its chunk
    #: unless ``same`` (the planner's ``LOOPS``: memsafe.split.strategies.selection's ``top_k`` in
    #: tiles).
    loop_strategies: tuple[LoopStrategy, ...] = ()
    #: Weight of the loop's iterations when choosing between axes.
    cost_weight: ClassVar[float] = 1.0
    #: Name added to the split's record (None: nothing to add).
    label: ClassVar[str | None] = None

    def fixed_bytes(self, graph: Graph) -> int:
        """Bytes the loops carry beyond the sinks' accumulators."""
        return 0

    def groups(
        self, graph: Graph, chunk: int, runner: chunk_loop.Runner = chunk_loop.run
    ) -> list[Group]:
        """The interpreter groups running the region in chunks of ``chunk``, each loop run by
        ``runner``."""
        loops = plan_loops(graph, self.region)
        covered = frozenset().union(*(lp.eqns for lp in loops))
        dead = frozenset(self.region.maps) - covered
        return [
            _loop_group(
                graph, self.region, lp, chunk, dead if k == 0 else frozenset(), runner,
                self.same, self.pinned, self.loop_strategies,
            )
            for k, lp in enumerate(loops)
        ]  # fmt: skip
