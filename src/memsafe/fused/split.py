"""The fused strategy: a split the planner chose, run as one Pallas kernel where it can be.

:func:`fuse` is the one hook the split planner calls (:mod:`memsafe.split.planner`): given the
split it planned for a region (a staged split of one stage, or an online one), it answers a
:class:`FusedSplit` where the policy (:mod:`.policy`) has fusion on and the region fits the form
a kernel runs, else the split unchanged. The form: no value written out along the split axis,
no scan along it, every sink foldable by tiles (:mod:`.reduce`), every equation evaluable on a
tile (:mod:`.tile`), and a row axis (:mod:`.rows`) every sink's result carries. The kernel is
traced once when planning (and lowered, where it is compiled): one that fails falls back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import jax

from memsafe._jax import Literal, Var
from memsafe.fused import kernel, reduce
from memsafe.fused.bodies import OnlineBody, StagedBody
from memsafe.fused.policy import FUSED, FusedPolicy
from memsafe.fused.rows import row_axes
from memsafe.fused.tile import NotFused, tileable
from memsafe.graph import Graph
from memsafe.graph.interpret import Group
from memsafe.split import loop as chunk_loop
from memsafe.split.emit import OneDevice, StagedSplit
from memsafe.split.online import OnlinePlan, OnlineSplit, raw_key
from memsafe.split.region import Region
from memsafe.split.registry import Mapping


@dataclass(frozen=True)
class FusedSplit(OneDevice):
    """A region run as one kernel (see the module's docstring).

    Attributes:
        region: the region.
        inputs: the values the kernel reads.
        gives: what its group defines: the sinks' results (an online region's deferred sinks:
            their unfinished accumulators, by :func:`memsafe.split.online.raw_key`).
        outputs: values of the kernel's results' shapes and dtypes, in ``gives`` order.
        run: the kernel, operands (``inputs`` order) -> results.
        plan: an online region's plan (its late factors are applied after the kernel), or None.
        tiles: rows by columns of each program's tile, for the plan's record.
    """

    region: Region
    inputs: tuple[Var, ...]
    gives: tuple[Any, ...]
    outputs: tuple[Var, ...]
    run: Callable[[list[Any]], list[Any]]
    plan: OnlinePlan | None
    tiles: tuple[int, int]
    #: A kernel never writes a chunk's values to memory: it beats every chunk loop.
    cost_weight: ClassVar[float] = 0.0

    @property
    def label(self) -> str:
        return f"fused[{self.tiles[0]}x{self.tiles[1]}]"

    def fixed_bytes(self, graph: Graph) -> int:
        """Bytes beside the sinks' results: none (the kernel holds tiles on chip)."""
        return 0

    def groups(
        self, graph: Graph, chunk: int, runner: chunk_loop.Runner = chunk_loop.run
    ) -> list[Group]:
        """The kernel (whatever ``chunk``: its tiles are its own), and for an online region
        the late factors applied to the deferred accumulators after it."""
        group = Group(
            eqns=frozenset(self.region.maps),
            needs=self.inputs,
            gives=self.gives,
            position=min(self.region.maps),
            run=self.run,
        )
        return (
            [group] if self.plan is None or not self.plan.deferred else [group, self._late(graph)]
        )

    def _late(self, graph: Graph) -> Group:
        """Deferred sinks' results: their accumulators times their late factors."""
        plan = self.plan
        assert plan is not None

        def finish(vals: list[Any]) -> list[Any]:
            accs, late = vals[: len(plan.deferred)], vals[len(plan.deferred) :]
            bases = dict(zip(plan.late, late))
            out = []
            for i, acc in zip(plan.deferred, accs):
                f = plan.factors[i].value(graph, bases)
                out.append(acc if f is None else acc * f.astype(acc.dtype))
            return out

        return Group(
            eqns=frozenset(),
            needs=(*(raw_key(i) for i in plan.deferred), *plan.late),
            gives=tuple(o for i in plan.deferred for o in graph.eqns[i].outvars),
            position=max(self.region.maps),
            run=finish,
        )


def fuse(graph: Graph, split: Any, policy: FusedPolicy | None = None) -> Any:
    """``split`` as a :class:`FusedSplit` where ``policy`` (default :data:`FUSED`) has fusion
    on and its region fits a kernel; else ``split`` itself."""
    policy = FUSED if policy is None else policy
    if not policy.active():
        return split
    try:
        return _fused(graph, split, policy)
    except NotFused:
        return split


def _inputs(
    graph: Graph, order: tuple[int, ...], kept: dict[int, int] | None = None
) -> tuple[Var, ...]:
    """Values the equations ``order`` read and do not compute, in order of first use; of an
    equation in ``kept`` (an online plan's pass-through products), only the operand it keeps."""
    made = {o for i in order for o in graph.eqns[i].outvars}
    kept = kept or {}
    seen: dict[Var, None] = {}
    for i in order:
        for k, a in enumerate(graph.eqns[i].invars):
            if i in kept and k != kept[i]:
                continue  # the late factor, applied after the kernel
            if not isinstance(a, Literal) and a not in made:
                seen[a] = None
    return tuple(seen)


def _fused(graph: Graph, split: Any, policy: FusedPolicy) -> FusedSplit:
    region = split.region
    if region.size < policy.cols:
        raise NotFused("the split axis is shorter than one tile: nothing to stream")
    if region.windowed or region.surviving:
        raise NotFused("the region writes values along the axis or runs on extended chunks")
    if any(region.running(graph, i) is not None for i in region.maps):
        raise NotFused("the region scans along the axis")
    if any(not reduce.foldable(s.reducer) for s in region.sinks.values()):
        raise NotFused("a sink no kernel folds")
    plan: OnlinePlan | None = None
    if isinstance(split, OnlineSplit):
        plan = split.plan
        if set(plan.chain) & set(region.maps):
            raise NotFused("a shift needs a generator of the region")
        order = tuple(sorted(set(region.maps) | set(plan.chain)))
    elif type(split) is StagedSplit and not split.same and region.n_stages == 1:
        order = tuple(region.stage_eqns(graph, 0))
    else:
        raise NotFused("neither one stage nor one online loop")
    for i in order:
        m = region.maps.get(i)
        if (m is None or isinstance(m, Mapping)) and not tileable(graph.eqns[i]):
            raise NotFused(f"{graph.eqns[i].primitive.name} is not evaluated on tiles")
    sinks = [i for i in order if i in region.sinks]
    written = [o for i in sinks for o in graph.eqns[i].outvars]
    rows = row_axes(graph, frozenset(order), region.seed, region.seed_axis, written)
    if not rows:
        raise NotFused("no row axis carries through the region")
    widest = max(range(len(rows)), key=lambda k: rows[k].size)
    tiles = tuple(min(policy.rows, r.size) if k == widest else 1 for k, r in enumerate(rows))
    layout = kernel.Layout(region.size, min(policy.cols, region.size), region.axis_of, rows, tiles)
    if plan is None:
        body: Any = StagedBody(graph, region, layout, order)
        gives: tuple[Any, ...] = tuple(written)
        outputs = tuple(written)
    else:
        others = tuple(i for i in sinks if i not in plan.sources)
        body = OnlineBody(graph, region, layout, plan, order, others)
        deferred = set(plan.deferred)
        gives = tuple(
            x for i in sinks for x in ([raw_key(i)] if i in deferred else graph.eqns[i].outvars)
        )
        outputs = tuple(
            o
            for i in sinks
            for o in (graph.eqns[i].outvars[:1] if i in deferred else graph.eqns[i].outvars)
        )
    inputs = _inputs(graph, order, None if plan is None else plan.passthrough)
    run = kernel.call(layout, inputs, outputs, body, policy.interpret)
    _check(run, inputs, policy)
    return FusedSplit(region, inputs, gives, outputs, run, plan, (tiles[widest], layout.cols))


def _check(run: Callable[[list[Any]], list[Any]], inputs: tuple[Var, ...], policy: FusedPolicy):
    """Trace the kernel once (and lower it, where it is compiled): one that cannot be built
    raises :class:`NotFused`, and the planner keeps its chunk loops."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in inputs]
    try:
        if policy.check_lowering and not policy.interpret:
            jax.jit(lambda *xs: run(list(xs))).lower(*avals)
        else:
            jax.eval_shape(lambda *xs: run(list(xs)), *avals)
    except NotFused:
        raise
    except Exception as err:  # Pallas refusing a block shape or an operation: the chunk loops
        raise NotFused(f"the kernel cannot be built: {type(err).__name__}: {err}") from err
