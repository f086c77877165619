"""The ``Split`` protocol, and the program re-traced with a split's loops as interpreter groups.

A split (a strategy's answer for a region: memsafe.split.strategies' staged, online, sharded
splits) gives the groups of the graph interpreter (memsafe.graph.interpret) that run its region
in chunks; :func:`emit` re-traces the program through them, in a dependency order that keeps the
original program order wherever it can. :func:`plan_loops` reads a region's stages as loops
(:class:`Loop`), and :class:`LoopStrategy` is the protocol of the other ways a staged loop may
run than chunk by chunk (the planner's ``LOOPS``: memsafe.split.strategies.selection's ``top_k``
in tiles); the staged split itself is memsafe.split.strategies.staged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import jax

from memsafe._jax import ClosedJaxpr, Var, is_var, make_closed_jaxpr
from memsafe.graph import Graph
from memsafe.graph.interpret import Group, evaluate
from memsafe.split import loop as chunk_loop
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
        ``runner`` (on a mesh, a ``memsafe.split.loop.DevicesRunner``)."""
        ...


class LoopStrategy(Protocol):
    """Another way to run one loop of a staged split than chunk by chunk: its :class:`LoopPlan`
    for ``loop`` (a stage of ``region``) at ``chunk`` on each of ``devices`` sharing the axis,
    or None where it does not apply. Asked only where the loop computes its values as it likes
    (not ``StagedSplit.same``) on plain chunks; it may be asked several times for one loop."""

    def __call__(
        self, graph: Graph, region: Region, loop: Loop, chunk: int, devices: int
    ) -> LoopPlan | None: ...


class OneDevice:
    """What a split on one device says of devices: one device, and the whole axis as that
    device's share (memsafe.split.strategies.sharded wraps a split to shard it, and says more:
    the mesh axes the plan records)."""

    region: Region
    devices: ClassVar[int] = 1

    @property
    def share(self) -> int:
        """Length of the axis one device runs in chunks: all of it."""
        return self.region.size


class Split(Protocol):
    """How a region runs: a staged split or an online one (memsafe.split.strategies.online)."""

    region: Region
    cost_weight: ClassVar[float]
    label: ClassVar[str | None]

    @property
    def devices(self) -> int:
        """Devices sharing the axis, each looping over an equal share of it."""
        ...

    @property
    def share(self) -> int:
        """Length of the axis each device runs in chunks."""
        ...

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
