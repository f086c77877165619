"""Emitting a split region as sequential loops, and re-tracing the program around them.

A staged region runs one loop per stage (memsafe.split.loop drives each); the loops replace the
region's equations as groups of the graph interpreter (memsafe.graph.interpret), which runs them
in a dependency order that keeps the original program order wherever it can. A loop may run
another way than chunk by chunk: the split's loop strategies (:class:`LoopStrategy`, the
planner's ``LOOPS``; memsafe.split.selection's ``top_k`` in tiles) are asked first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import jax
from jax import lax

from memsafe._jax import ClosedJaxpr, Literal, Var, is_var, make_closed_jaxpr
from memsafe.graph import Graph
from memsafe.graph.interpret import Group, evaluate
from memsafe.split import loop as chunk_loop
from memsafe.split import peephole
from memsafe.split.devices import DevicesRunner
from memsafe.split.loop import ChunkEnv, Fold, Written
from memsafe.split.region import Region
from memsafe.split.registry import Mapping
from memsafe.split.sinks import Sink


@dataclass(frozen=True)
class Loop:
    """One stage of a region: the equations it evaluates per chunk, what it reads and returns."""

    stage: int
    eqns: tuple[int, ...]
    sliced: tuple[Var, ...]
    whole: tuple[Var, ...]
    sinks: tuple[int, ...]
    threads: tuple[int, ...]  # scans along the axis whose final carries are used
    surviving: tuple[Var, ...]
    outputs: tuple[Var, ...]  # sink results, final carries, surviving values, in that order

    def group(self, dead: frozenset[int], run: Callable[[list[Any]], list[Any]]) -> Group:
        """The loop as a group of the graph interpreter: ``run`` maps its operands (sliced, then
        whole) to its outputs; it also covers the region's ``dead`` equations."""
        return Group(
            eqns=frozenset(self.eqns) | dead,
            needs=(*self.sliced, *self.whole),
            gives=self.outputs,
            position=min(self.eqns),
            run=run,
        )


def plan_loops(graph: Graph, region: Region) -> list[Loop]:
    eqns = graph.eqns
    loops = []
    for k in range(region.n_stages):
        idx = region.stage_eqns(graph, k)
        if not idx:
            continue
        members = set(idx)
        sliced: dict[Var, None] = {}
        whole: dict[Var, None] = {}
        for i in idx:
            m = region.maps[i]
            for atom, ax in zip(eqns[i].invars, m.ins):
                if not is_var(atom):
                    continue
                if atom in region.produced and graph.info(atom).producer in members:
                    continue
                (sliced if ax is not None else whole)[atom] = None
        sinks = tuple(i for i in idx if isinstance(region.maps[i], Sink) and region.stage[i] == k)
        surv = set(region.surviving)
        surviving = tuple(
            o
            for i in idx
            if region.stage[i] == k and isinstance(region.maps[i], Mapping)
            for o in eqns[i].outvars
            if o in surv
        )
        threads = tuple(i for i in idx if region.stage[i] == k and region.after_loop(graph, i))
        outputs = (
            tuple(o for i in sinks for o in eqns[i].outvars)
            + tuple(o for i in threads for o in region.after_loop(graph, i))
            + surviving
        )
        loops.append(
            Loop(k, tuple(idx), tuple(sliced), tuple(whole), sinks, threads, surviving, outputs)
        )
    return loops


def unwrapped(split: Any) -> Any:
    """The split a mesh wrapper (``.inner``) shards, or ``split`` itself."""
    while hasattr(split, "inner"):
        split = split.inner
    return split


class LoopPlan(Protocol):
    """One loop of a staged split as a loop strategy runs it (:class:`LoopStrategy`)."""

    #: Positions of the axis each of its iterations covers (shown as the split's chunk).
    step: int

    @property
    def loops(self) -> int:
        """Iterations it runs (on each device)."""
        ...

    def describe(self) -> str:
        """What the plan says of the loop, beside its sinks."""
        ...

    def run(self, operands: list[Any], runner: chunk_loop.Runner) -> list[Any]:
        """The loop's outputs from its operands (sliced, then whole), its iterations run by
        ``runner`` (on a mesh, a ``memsafe.split.devices.DevicesRunner``)."""
        ...


class LoopStrategy(Protocol):
    """Another way to run one loop of a staged split than chunk by chunk: its :class:`LoopPlan`
    for ``loop`` (a stage of ``region``) at ``chunk`` on each of ``devices`` sharing the axis,
    or None where it does not apply. Asked only where the loop computes its values as it likes
    (not ``StagedSplit.same``) on plain chunks; it may be asked several times for one loop."""

    def __call__(
        self, graph: Graph, region: Region, loop: Loop, chunk: int, devices: int
    ) -> LoopPlan | None: ...


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
    """The loop of ``split`` a loop strategy runs (memsafe.split.selection's ``top_k`` in
    tiles), if any: a staged split, on one device or sharded over a mesh (memsafe.mesh)."""
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
    the results of the equations in ``pinned`` held behind a barrier (:meth:`ChunkEnv.pin`)."""
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

    def body(start: Any, n: int, ops: list[Any], fed: Any) -> tuple[list, list]:
        whole = dict(zip(loop.whole, ops[n_sliced:]))
        sliced = list(zip(loop.sliced, ops[:n_sliced]))
        env = ChunkEnv.slice_in(graph, region, peep, start, n, sliced, whole, fed)
        parts = []
        for i in loop.eqns:
            if i in peep.skip:
                continue
            if not isinstance(region.maps[i], Sink):
                env.bind(i)
                if i in pinned:
                    env.pin(i)
            elif i in loop.sinks:
                parts.append(env.partial(i))
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


class OneDevice:
    """What a split on one device says of devices (memsafe.mesh wraps a split to shard it):
    one device, no mesh axes, and the whole axis as that device's share."""

    region: Region
    devices: ClassVar[int] = 1
    mesh_axes: ClassVar[tuple[str, ...]] = ()

    @property
    def share(self) -> int:
        """Length of the axis one device runs in chunks: all of it."""
        return self.region.size


@dataclass(frozen=True)
class StagedSplit(OneDevice):
    """A region run as one loop per stage, each recomputing what it needs from the leaves."""

    region: Region
    #: Its later loops compare values they recompute: every loop computes them the same way
    #: (no peephole moves, no tiles; :mod:`memsafe.split.recompute`).
    same: bool = False
    #: Equations whose results a comparison reads, computed alone in every loop that evaluates
    #: them (:meth:`ChunkEnv.pin`, :func:`memsafe.split.recompute.pinned`).
    pinned: frozenset[int] = frozenset()
    #: Other ways to run a loop than chunk by chunk, tried in order for each loop at its chunk
    #: unless ``same`` (the planner's ``LOOPS``: memsafe.split.selection's ``top_k`` in tiles).
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


class Split(Protocol):
    """How a region runs: a staged split or an online one (memsafe.split.online)."""

    region: Region
    cost_weight: ClassVar[float]
    label: ClassVar[str | None]

    @property
    def devices(self) -> int: ...

    @property
    def mesh_axes(self) -> tuple[str, ...]: ...

    @property
    def share(self) -> int: ...

    def fixed_bytes(self, graph: Graph) -> int: ...

    def groups(
        self, graph: Graph, chunk: int, runner: chunk_loop.Runner = chunk_loop.run
    ) -> list[Group]: ...


def emit(closed: ClosedJaxpr, graph: Graph, split: Split, chunk: int) -> ClosedJaxpr:
    """``closed`` (whose graph is ``graph``) with ``split``'s region computed in chunks of
    ``chunk`` along its axis, re-traced through the graph interpreter."""
    groups = split.groups(graph, chunk)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    new, _ = make_closed_jaxpr(lambda *xs: evaluate(closed, xs, groups=groups), avals)
    return new
