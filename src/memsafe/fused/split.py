"""The fused strategy: a split the planner chose, run as Pallas kernels where it can be.

:func:`fuse` is the one hook the split planner calls (added to
:data:`memsafe.split.planner.REPLACING` when this module is imported): given the
split it planned for a region (a staged split, one kernel per stage, or an online one, one
kernel), it answers a :class:`FusedSplit` where the policy (:mod:`.policy`) has fusion on and
the region fits the form a kernel runs, else the split unchanged. The form: no value written out
along the split axis, no scan along it, every sink foldable by tiles (:mod:`.reduce`), every
equation evaluable on a tile (:mod:`.tile`), and a row axis (:mod:`.rows`) every sink's result
carries. Each kernel is traced once when planning (and lowered, where it is compiled): one that
cannot be built falls back to the chunk loops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax

from memsafe._jax import Literal, Var
from memsafe.fused import kernel, reduce
from memsafe.fused import policy as policies
from memsafe.fused.bodies import OnlineBody, StagedBody
from memsafe.fused.policy import FusedPolicy
from memsafe.fused.rows import row_axes
from memsafe.fused.tile import NotFused, tileable
from memsafe.graph import Graph
from memsafe.graph.interpret import Group
from memsafe.split import loop as chunk_loop
from memsafe.split import planner
from memsafe.split.emit import OneDevice, plan_loops
from memsafe.split.region import Region
from memsafe.split.registry import Mapping
from memsafe.split.strategies.online import OnlinePlan, OnlineSplit, late_factors, raw_key
from memsafe.split.strategies.staged import StagedSplit


@dataclass(frozen=True)
class Kernel:
    """One kernel of a fused split.

    Attributes:
        eqns: the equations it evaluates (program indices).
        inputs: the values it reads.
        gives: what its group defines: sinks' results (an online region's deferred sinks: their
            unfinished accumulators, by :func:`memsafe.split.strategies.online.raw_key`).
        run: the kernel, operands (``inputs`` order) -> results (``gives`` order).
        tiles: rows by columns of each program's tile.
    """

    eqns: tuple[int, ...]
    inputs: tuple[Var, ...]
    gives: tuple[Any, ...]
    run: Callable[[list[Any]], list[Any]]
    tiles: tuple[int, int]


@dataclass(frozen=True)
class FusedSplit(OneDevice):
    """A region run as kernels (see the module's docstring): one per stage of a staged region,
    one for an online region (whose late factors are applied after it, ``plan``)."""

    region: Region
    kernels: tuple[Kernel, ...]
    plan: OnlinePlan | None = None
    #: A kernel never writes a chunk's values to memory: it beats every chunk loop.
    cost_weight: ClassVar[float] = 0.0

    @property
    def label(self) -> str:
        """What the plan's record says: ``fused[rows x columns]`` of the first kernel's tile."""
        rows, cols = self.kernels[0].tiles
        return f"fused[{rows}x{cols}]"

    def fixed_bytes(self, graph: Graph) -> int:
        """Bytes beside the sinks' results: none (a kernel holds its tiles on chip)."""
        return 0

    def groups(
        self, graph: Graph, chunk: int, runner: chunk_loop.Runner = chunk_loop.run
    ) -> list[Group]:
        """The kernels (whatever ``chunk``: their tiles are their own), and for an online
        region the late factors applied to the deferred accumulators after its kernel."""
        groups = [
            Group(
                eqns=frozenset(self.region.maps) if k == 0 else frozenset(kn.eqns),
                needs=kn.inputs,
                gives=kn.gives,
                position=min(kn.eqns),
                run=kn.run,
            )
            for k, kn in enumerate(self.kernels)
        ]
        if self.plan is not None and self.plan.deferred:
            groups.append(late_factors(graph, self.region, self.plan))
        return groups


def fuse(graph: Graph, split: Any, policy: FusedPolicy | None = None) -> Any:
    """``split`` as a :class:`FusedSplit` where ``policy`` (default
    :data:`memsafe.fused.policy.FUSED`) has fusion on and its region fits kernels; else
    ``split`` itself."""
    policy = policies.FUSED if policy is None else policy
    if not policy.active():
        return split
    try:
        return _fused(graph, split, policy)
    except NotFused:
        return split


def _fused(graph: Graph, split: Any, policy: FusedPolicy) -> FusedSplit:
    region = split.region
    if region.size < policy.cols:
        raise NotFused("the split axis is shorter than one tile: nothing to stream")
    if not region.span.plain or region.surviving:
        raise NotFused("the region writes values along the axis or runs on extended chunks")
    if any(region.running(graph, i) is not None for i in region.maps):
        raise NotFused("the region scans along the axis")
    if any(not reduce.foldable(s.reducer) for s in region.sinks.values()):
        raise NotFused("a sink no kernel folds")
    if isinstance(split, OnlineSplit):
        return FusedSplit(region, (_online(graph, region, split.plan, policy),), split.plan)
    if type(split) is not StagedSplit or split.same:
        raise NotFused("later loops compare values they recompute, or an unknown strategy")
    kernels = []
    for lp in plan_loops(graph, region):
        if lp.surviving or lp.threads:
            raise NotFused("a loop writes values along the axis")
        kernels.append(_staged(graph, region, lp.eqns, lp.sinks, policy))
    return FusedSplit(region, tuple(kernels))


def _staged(
    graph: Graph, region: Region, order: tuple[int, ...], sinks: tuple[int, ...], pol: FusedPolicy
) -> Kernel:
    """The kernel of one stage's loop: equations ``order``, folding ``sinks``."""
    written = tuple(o for i in sinks for o in graph.eqns[i].outvars)
    layout = _layout(graph, region, order, written, pol)
    body = StagedBody(graph, region, layout, order, sinks)
    return _kernel(order, written, written, body, layout, pol)


def _online(graph: Graph, region: Region, plan: OnlinePlan, pol: FusedPolicy) -> Kernel:
    """The kernel of an online loop: the region's and the plan's chain equations."""
    if set(plan.chain) & set(region.maps):
        raise NotFused("a shift needs a generator of the region")
    order = tuple(sorted(set(region.maps) | set(plan.chain)))
    sinks = sorted(region.sinks)
    deferred = set(plan.deferred)
    outs = [graph.eqns[i].outvars[:1] if i in deferred else graph.eqns[i].outvars for i in sinks]
    written = tuple(o for group in outs for o in group)
    gives = tuple(
        x for i in sinks for x in ([raw_key(i)] if i in deferred else graph.eqns[i].outvars)
    )
    layout = _layout(graph, region, order, written, pol)
    others = tuple(i for i in sinks if i not in plan.sources)
    body = OnlineBody(graph, region, layout, plan, order, others)
    return _kernel(order, gives, written, body, layout, pol, plan.passthrough)


def _layout(
    graph: Graph, region: Region, order: tuple[int, ...], written: tuple[Var, ...], pol: FusedPolicy
) -> kernel.Layout:
    """The tiles of a kernel evaluating ``order`` and writing ``written``: the policy's rows
    along the longest row axis, one along the others, the policy's columns along the split
    axis."""
    for i in order:
        m = region.maps.get(i)
        if (m is None or isinstance(m, Mapping)) and not tileable(graph.eqns[i]):
            raise NotFused(f"{graph.eqns[i].primitive.name} is not evaluated on tiles")
    rows = row_axes(graph, frozenset(order), region.seed, region.seed_axis, written)
    if not rows:
        raise NotFused("no row axis carries through the region")
    widest = max(range(len(rows)), key=lambda k: rows[k].size)
    tiles = tuple(min(pol.rows, r.size) if k == widest else 1 for k, r in enumerate(rows))
    return kernel.Layout(region.size, min(pol.cols, region.size), region.axis_of, rows, tiles)


def _kernel(
    order: tuple[int, ...],
    gives: tuple[Any, ...],
    written: tuple[Var, ...],
    body: Any,
    layout: kernel.Layout,
    pol: FusedPolicy,
    kept: dict[int, int] | None = None,
) -> Kernel:
    """The kernel running ``body`` (it evaluates ``order``, writes ``written``, defines
    ``gives``), traced once (:func:`_check`)."""
    graph = body.graph
    inputs = _inputs(graph, order, kept or {})
    run = kernel.call(layout, inputs, written, body, pol.interpret)
    _check(run, inputs, pol)
    rows = max(layout.tiles)
    return Kernel(order, inputs, gives, run, (rows, layout.cols))


def _inputs(graph: Graph, order: tuple[int, ...], kept: dict[int, int]) -> tuple[Var, ...]:
    """Values the equations ``order`` read and do not compute, in order of first use; of an
    equation in ``kept`` (an online plan's pass-through products), only the operand it keeps
    (the other, a late factor, is applied after the kernel)."""
    made = {o for i in order for o in graph.eqns[i].outvars}
    seen: dict[Var, None] = {}
    for i in order:
        for k, a in enumerate(graph.eqns[i].invars):
            if i in kept and k != kept[i]:
                continue
            if not isinstance(a, Literal) and a not in made:
                seen[a] = None
    return tuple(seen)


def _check(run: Callable[[list[Any]], list[Any]], inputs: tuple[Var, ...], pol: FusedPolicy):
    """Trace the kernel once (and lower it, where it is compiled): one that cannot be built
    raises :class:`NotFused`, and the planner keeps its chunk loops."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs]
    try:
        if pol.check_lowering and not pol.interpret:
            jax.jit(lambda *xs: run(list(xs))).lower(*avals)
        else:
            jax.eval_shape(lambda *xs: run(list(xs)), *avals)
    except NotFused:
        raise
    except Exception as err:  # Pallas refusing a block shape or an operation: the chunk loops
        raise NotFused(f"the kernel cannot be built: {type(err).__name__}: {err}") from err


if fuse not in planner.REPLACING:  # the planner's one hook: splits on one device
    planner.REPLACING.append(fuse)
