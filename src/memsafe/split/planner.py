"""The split planner: which values to split, along which axis, and how.

For each intermediate larger than a share of the temporary budget (:func:`candidates`, largest
first), every axis is tried: the region that axis allows is grown (:mod:`memsafe.split.region`),
it is planned (:func:`strategy`: one online loop for staged max-shifted exp-sums,
:mod:`memsafe.split.strategies.online`, else one loop per stage), its chunk chosen from the budget
(:mod:`memsafe.split.size`), and the option with the fewest loop iterations wins
(:func:`cheapest_split`). Where no axis splits, the retries of :data:`RETRIES` grow the regions
again in their own rule context (:mod:`memsafe.split.strategies.replay`: loops replayed per chunk of
an accumulator). :mod:`memsafe.split.program` runs this over a whole program and its loop bodies;
the split pass (:mod:`memsafe.passes.split`) runs that.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

from memsafe import policy
from memsafe._jax import Var
from memsafe.graph import Graph, estimate
from memsafe.primitives import FUSIBLE
from memsafe.split.emit import LoopStrategy, Split
from memsafe.split.region import Region, SplitFailure, check_stores, grow
from memsafe.split.registry import PLAIN, RuleContext
from memsafe.split.size import ChunkPlan, choose_chunk, smallest_chunk, two_chunks
from memsafe.split.span import Spanning
from memsafe.split.strategies import halo, online, recompute, replay, selection
from memsafe.split.strategies.staged import StagedSplit


def candidates(graph: Graph, budget: int, limit: int | None = None) -> list[Var]:
    """Intermediates over ``budget / share`` bytes, largest first. Where none is, but the program
    is still estimated over ``limit`` (many moderate values alive at once, as in a deep
    network's backward pass), those over ``budget / many_share`` (``policy.SPLIT``)."""
    values = [
        vi
        for vi in graph.values()
        if vi.producer is not None and not vi.is_output and vi.consumers  # dead: XLA drops it
    ]
    out = [vi for vi in values if vi.bytes > budget // policy.SPLIT.share]
    if not out and limit is not None and estimate(graph).peak_bytes > limit:
        out = [vi for vi in values if vi.bytes > budget // policy.SPLIT.many_share]
    out.sort(key=lambda vi: (-vi.bytes, vi.producer))
    return [vi.var for vi in out]


class Strategy(Protocol):
    """One way a grown region may run: its :class:`~memsafe.split.emit.Split`, or None where
    the strategy does not apply to the region."""

    def __call__(self, graph: Graph, region: Region) -> Split | None: ...


def staged(graph: Graph, region: Region) -> Split:
    """One loop per stage, computing the values its later loops recompute and compare the same
    way in every loop (:mod:`memsafe.split.strategies.recompute`): every region runs so. Where no
    loop compares, each loop may run as one of :data:`LOOPS` runs it."""
    if not recompute.decides_on_recomputed(graph, region):
        return StagedSplit(region, loop_strategies=tuple(LOOPS))
    return StagedSplit(region, same=True, pinned=recompute.pinned(graph, region))


#: The strategies tried for each region, in order: the first that applies plans it. The last,
#: :func:`staged`, applies to every region. Add one with :func:`add_strategy`.
STRATEGIES: list[Strategy] = [online.strategy, staged]
#: Spans a region grows on before its plain chunks (:mod:`memsafe.split.span`), in order, on one
#: device: the first that applies to the program and grows a region that is not plain wins
#: (:func:`_region`). memsafe.split.strategies.halo's extended chunks run several windowed
#: operations in a row in one loop.
SPANS: list[Spanning] = [halo.EXTENDED]
#: Other ways to run one loop of a staged split than chunk by chunk, asked in order for each
#: loop at its chunk (``memsafe.split.emit.LoopStrategy``); memsafe.split.strategies.selection runs
#: a loop whose only work is a ``top_k`` along the axis in tiles of its operand, never stored.
LOOPS: list[LoopStrategy] = [selection.plan]


class Sharder(Protocol):
    """What the planner knows of a mesh (the ``mesh`` of :func:`best_split`: a
    ``memsafe.split.strategies.sharded.mesh.Sharding``): it wraps each split planned on one
    device to run sharded over its devices. Spans (:data:`SPANS`) and :data:`REPLACING` apply
    on one device only."""

    def shard(self, graph: Graph, split: Split) -> Split:
        """``split`` sharded over the devices; raises SplitFailure where it cannot be."""
        ...


class Retry(Protocol):
    """A rule context the planner grows a value's regions in again where no axis of it splits
    in the plain one (:func:`best_split`): its splits may cost more (a replay runs a loop once
    per chunk), so they are tried only then."""

    def applies(self, graph: Graph) -> bool:
        """Whether retrying may split anything of ``graph`` (a loop that may replay, say)."""
        ...

    def context(self, ctx: RuleContext) -> RuleContext:
        """What the split rules are told in the retry, from ``ctx``."""
        ...


#: The retries :func:`best_split` tries in order where no axis of a value splits:
#: memsafe.split.strategies.replay's replays loops that only accumulate into a carry per chunk of
#: it.
RETRIES: list[Retry] = [replay.REPLAYING]
#: Strategies that may take the place of the split planned for a region on one device, in
#: order, each given the graph and the split so far (memsafe.fused adds its kernels here).
REPLACING: list[Callable[[Graph, Split], Split]] = []


def add_strategy(strategy: Strategy) -> Strategy:
    """Try ``strategy`` on every region before the others (it answers None where it does not
    apply); returns it, so that it can decorate a function."""
    STRATEGIES.insert(0, strategy)
    return strategy


def strategy(graph: Graph, region: Region) -> Split:
    """How ``region`` runs: the first of :data:`STRATEGIES` that applies (staged max-shifted
    exp-sums as one online loop, :mod:`memsafe.split.strategies.online`; else one loop per
    stage)."""
    for candidate in STRATEGIES:
        split = candidate(graph, region)
        if split is not None:
            return split
    raise AssertionError("no strategy applies; the staged one applies to every region")


def _option(
    graph: Graph,
    var: Var,
    axis: int,
    budget: int,
    mesh: Sharder | None = None,
    floor: int = 0,
    ctx: RuleContext = PLAIN,
    held: int = 0,
) -> tuple[Split, ChunkPlan]:
    """The split of ``var`` along ``axis`` (sharded over ``mesh``'s devices where given) and
    its chunk (``floor``: see :func:`smallest_chunk`; ``held``: see :func:`_region`); raises
    SplitFailure. On one device, the region on a span of :data:`SPANS` comes first
    (:func:`_region`)."""
    region = _region(graph, var, axis, budget, ctx, spans=SPANS if mesh is None else (), held=held)
    if mesh is None:
        check_stores(graph, region)
    split = strategy(graph, region)
    if mesh is not None:
        split = mesh.shard(graph, split)
    else:
        for replacing in REPLACING:
            split = replacing(graph, split)
    chunk = choose_chunk(graph, split, budget) or smallest_chunk(graph, split, floor)
    if chunk.loops * chunk.devices < 2:
        chunk = two_chunks(graph, split, chunk)
        if chunk is None:
            raise SplitFailure("the axis is too short to split", inherent=True)
    return split, chunk


def _region(
    graph: Graph,
    var: Var,
    axis: int,
    budget: int,
    ctx: RuleContext,
    spans: Sequence[Spanning],
    held: int = 0,
) -> Region:
    """The region splitting ``var`` along ``axis``: on the first of ``spans`` that applies to
    the program and grows a region whose span is not plain (extended chunks where the program
    has convolutions, :mod:`memsafe.split.strategies.halo`), else on plain chunks. Values the region
    reads or writes whole may take half of ``budget``, or of ``held`` where larger (see
    :func:`best_split`); values computed outside and read chunk by chunk over half of
    ``budget`` must then be smaller than ``var`` (``sliced_large`` of
    :func:`memsafe.split.region.grow`)."""
    small, large = max(1, budget // policy.SPLIT.small), max(1, max(budget, held) // 2)
    sliced = max(1, budget // 2) if held > budget else None
    for spanning in spans:
        if not spanning.applies(graph):
            continue
        try:
            region = grow(graph, var, axis, small, large, ctx, sliced, spanning)
        except SplitFailure:
            continue
        if not region.span.plain:
            return region
    return grow(graph, var, axis, small, large, ctx, sliced)


def best_split(
    graph: Graph,
    var: Var,
    budget: int,
    mesh: Sharder | None = None,
    floor: int = 0,
    room: int = 0,
    floored_held: bool = False,
    declined: Callable[[], None] | None = None,
) -> tuple[Split, ChunkPlan] | list[tuple[int, SplitFailure]]:
    """:func:`cheapest_split`; where no axis splits, the same in each retry of :data:`RETRIES`
    that applies (loops replayed per chunk of an accumulator,
    :mod:`memsafe.split.strategies.replay`: their work once per chunk), then, where the ``room`` for
    temporaries is larger than the (chunk-scaled) ``budget``, the same with values held whole beside
    the loop measured against the room; the first failures where none splits.

    A smaller chunk scale shrinks the chunks; a value the loop reads or writes whole (a
    segment sum's node-sized accumulator) is as large at any scale. Measured against the
    scaled budget only, the attempts after one over the limit dropped such splits altogether
    and compiled the program unsplit (a graph network's round under 0.9 MiB: the second of
    its attempts back at jax.jit's 4.1 MiB; held against the room, 0.73 MiB).

    That retry's floored splits (chunks the model expects over the budget even at their
    smallest) are taken only where ``floored_held``: they are guesses that can cost a loop per
    position (a GPT training step's attention scores in 1,024 chunks of one row, its step 6x
    slower, where the step fit without them), and the driver allows them only once an
    attempt at a shrunk chunk scale was over the limit (fuzz seeds 37 and 78 fit only with
    them). Where such a split is found and not taken, ``declined`` is called: the driver makes
    that attempt again with them (:meth:`memsafe.search.Search.attempts`)."""
    got = cheapest_split(graph, var, budget, mesh, floor)
    if not isinstance(got, list):
        return got
    for retry in RETRIES:
        if retry.applies(graph):
            retried = cheapest_split(graph, var, budget, mesh, floor, retry.context(PLAIN))
            if not isinstance(retried, list):
                return retried
    if room > budget:
        held = cheapest_split(graph, var, budget, mesh, floor, held=room)
        if not isinstance(held, list):
            if floored_held or not held[1].floored:
                return held[0], dataclasses.replace(held[1], held=True)
            if declined is not None:
                declined()
    return got


def cheapest_split(
    graph: Graph,
    var: Var,
    budget: int,
    mesh: Sharder | None = None,
    floor: int = 0,
    ctx: RuleContext = PLAIN,
    held: int = 0,
) -> tuple[Split, ChunkPlan] | list[tuple[int, SplitFailure]]:
    """The cheapest way to split ``var`` (``held``: what values held whole may take, see
    :func:`_region`; fewest loop iterations; chunks the model expects to fit
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
            options.append(_option(graph, var, axis, budget, mesh, floor, ctx, held))
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
    close = [o for o in options if _cost(*o) <= policy.SPLIT.similar_cost * fewest]
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
