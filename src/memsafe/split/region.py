"""Finding a split region: the equations that can run chunk by chunk along one axis of a value.

Starting from a large value and one of its axes, the axis is propagated backwards through
producers (to program inputs, small values computed outside, or generators such as iota and
broadcasts that are regenerated per chunk) and forwards through consumers until it is consumed by
a sink (reductions, argmax/argmin, dot_general contracting it, top_k along it) or survives into a
small value / program output (written chunk by chunk into a full buffer).

When a value the region reads from outside depends on one of the region's own results (softmax:
``exp(s - max(s))`` needs the max over every chunk first), the region runs in *stages*: one loop
per stage, each recomputing what it needs from the leaves (eXLA's first splitter recomputed
shared work the same way).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from memsafe import policy
from memsafe._jax import JaxprEqn, Var, is_var, source_line
from memsafe.graph import Graph
from memsafe.primitives import CHEAP, STREAMED
from memsafe.split.registry import (
    PLAIN,
    Mapping,
    NoRule,
    RuleContext,
    Running,
    axis_map,
    running_along,
)
from memsafe.split.sinks import Sink
from memsafe.split.span import PLAIN_SPAN, Span, Spanning


@dataclass
class SplitFailure(Exception):
    """Why a value cannot be split along an axis: the stopping equation and the reason."""

    reason: str
    eqn: JaxprEqn | None = None
    inherent: bool = False  # no chunked program along this axis exists (see NoRule)

    @property
    def operation(self) -> str:
        return self.eqn.primitive.name if self.eqn is not None else "split"

    @property
    def where(self) -> str:
        return source_line(self.eqn) if self.eqn is not None else ""

    def __str__(self) -> str:
        return f"{self.operation}: {self.reason}"


@dataclass(frozen=True)
class Region:
    """Equations that run chunk by chunk along a split dimension of length ``size``.

    Built once by :func:`grow` and never changed: planning returns new objects
    (:meth:`one_stage`, the split strategies of memsafe.split.emit and
    memsafe.split.strategies.online).
    """

    seed: Var
    seed_axis: int
    size: int
    maps: dict[int, Mapping | Sink]  # region equation index -> how the axis maps through it
    axis_of: dict[Var, int]  # split axis of every region value and sliced leaf
    produced: frozenset[Var]  # values computed inside the region
    #: Outside values sliced per chunk, and those used whole, each in program order (a loop
    #: reads them in this order: its operands, and so the emitted loop's, never follow ids).
    sliced: tuple[Var, ...]
    whole: tuple[Var, ...]
    surviving: tuple[Var, ...]  # region values needed outside: written chunk by chunk
    stage: dict[int, int]  # region equation index -> the loop (stage) that evaluates it
    #: What a chunk covers of each value (:mod:`memsafe.split.span`): the chunk itself, unless
    #: the region grew on a strategy's span (extended chunks, memsafe.split.strategies.halo).
    span: Span = PLAIN_SPAN

    @property
    def eqns(self) -> list[int]:
        return sorted(self.maps)

    @property
    def sinks(self) -> dict[int, Sink]:
        return {i: m for i, m in self.maps.items() if isinstance(m, Sink)}

    @property
    def n_stages(self) -> int:
        return 1 + max(self.stage.values(), default=0)

    def after_loop(self, graph: Graph, i: int) -> tuple[Var, ...]:
        """Results of mapped equation ``i`` that exist only after the loop (a scan's final
        carry, threaded through the chunks) and are read (a dead one, such as a loop's counter,
        is not carried)."""
        return tuple(graph.eqns[i].outvars[k] for k in self.after_loop_positions(graph, i))

    def after_loop_positions(self, graph: Graph, i: int) -> tuple[int, ...]:
        """Positions of :meth:`after_loop`'s results among equation ``i``'s results."""
        m = self.maps[i]
        if not isinstance(m, Mapping):
            return ()
        outs = graph.eqns[i].outvars
        return tuple(
            k
            for k, (o, ax) in enumerate(zip(outs, m.outs))
            if ax is None and (graph.info(o).consumers or graph.info(o).is_output)
        )

    def running(self, graph: Graph, i: int) -> Running | None:
        """The rule of mapped equation ``i`` if it carries a value from chunk to chunk: it
        scans along the axis, or has results after the loop that are read."""
        m = self.maps[i]
        run = running_along(graph.eqns[i], m) if isinstance(m, Mapping) else None
        if run is None:
            return None
        return run.keeping(graph.eqns[i], m, frozenset(self.after_loop_positions(graph, i)))

    def one_stage(self) -> Region:
        """The same region evaluated by a single loop."""
        return dataclasses.replace(self, stage=dict.fromkeys(self.maps, 0))

    def stage_eqns(self, graph: Graph, k: int) -> list[int]:
        """Equations loop ``k`` evaluates: its sinks and surviving outputs, and their ancestors
        (up to the values :meth:`read_back` says it reads from an earlier loop's buffers)."""
        eqns = graph.eqns
        surviving = set(self.surviving)
        targets = [
            i
            for i, m in self.maps.items()
            if self.stage[i] == k
            and (
                isinstance(m, Sink)
                or any(o in surviving for o in eqns[i].outvars)
                or self.after_loop(graph, i)
            )
        ]
        return sorted(self.ancestors(graph, targets, self.read_back(graph, k)))

    def ancestors(
        self, graph: Graph, targets: list[int], stop: frozenset[Var] = frozenset()
    ) -> set[int]:
        """Equations ``targets`` and those of the region computing what they read in the loop
        (not those computing ``stop``, read as they are)."""
        eqns = graph.eqns
        need: set[int] = set()
        stack = list(targets)
        while stack:
            i = stack.pop()
            if i in need:
                continue
            need.add(i)
            for atom in eqns[i].invars:
                if isinstance(atom, Var) and atom in self.produced and atom not in stop:
                    p = graph.info(atom).producer
                    if p is not None and p in self.maps:
                        stack.append(p)
        return need

    def read_back(self, graph: Graph, k: int) -> frozenset[Var]:
        """Values loop ``k`` reads chunk by chunk from the buffers an earlier loop wrote them
        into, rather than computing them again from the region's leaves.

        An earlier loop writes a surviving value whole (it is needed outside the region), so a
        later loop can slice it like an input. Computed again, it would keep the leaves it is
        computed from alive until the later loop: a graph network's node update, split along
        the nodes in one region over its rounds (each round's loop reads the node state the
        round before wrote), held every round's segment sums, read per chunk, until the last
        round's loop (9 aggregates of 55 KiB where the round's 3 were needed). A value is
        read back where its bytes are at most those of the computed values (not the program's
        inputs, held anyway) its recomputation reads, or where it is an output (held to the
        end anyway). Only on plain chunks: an extended chunk (memsafe.split.halo) computes its
        halo again in every loop."""
        if k == 0 or not self.span.plain:
            return frozenset()
        surviving = set(self.surviving)
        eqns = graph.eqns
        earlier = [
            o
            for i in self.maps
            if self.stage[i] < k and isinstance(self.maps[i], Mapping)
            for o in eqns[i].outvars
            if o in surviving
        ]
        return frozenset(v for v in earlier if self._cheaper_read(graph, v))

    def _cheaper_read(self, graph: Graph, var: Var) -> bool:
        """Whether holding ``var`` (an earlier loop's surviving value) for a later loop costs no
        more than holding the computed values outside the region its recomputation reads."""
        info = graph.info(var)
        if info.is_output:
            return True
        p = info.producer
        leaves = {
            atom
            for i in self.ancestors(graph, [] if p is None else [p])
            for atom in graph.eqns[i].invars
            if isinstance(atom, Var)
            and atom not in self.produced
            and graph.info(atom).producer is not None
        }
        return info.bytes <= sum(graph.info(v).bytes for v in leaves)


@dataclass
class _Growth:
    """The state of :func:`grow` while the axis propagates (one region's worth of dicts)."""

    graph: Graph
    size: int
    small: int
    ctx: RuleContext
    spanning: Spanning
    maps: dict[int, Mapping | Sink] = field(default_factory=dict)
    axis_of: dict[Var, int] = field(default_factory=dict)
    whole_uses: list[tuple[Var, int]] = field(default_factory=list)
    queue: deque[Var] = field(default_factory=deque)
    stopped_back: dict[Var, SplitFailure] = field(default_factory=dict)
    stopped_fwd: dict[Var, SplitFailure] = field(default_factory=dict)
    reverse: bool | None = None  # the direction of the region's scans along the axis
    #: Equations that stop the axis, each with why (see :func:`grow`).
    left_out: dict[int, SplitFailure] = field(default_factory=dict)

    def assign(self, atom: Any, ax: int | None, user: int) -> None:
        """``atom`` carries the axis at ``ax`` (None: ``user`` reads it whole)."""
        eqn = self.graph.eqns[user]
        if not is_var(atom):
            if ax is not None:
                raise SplitFailure("a literal cannot carry the split axis", eqn)
            return
        if ax is None:
            self.whole_uses.append((atom, user))
            return
        prev = self.axis_of.get(atom)
        if prev is None:
            if not self.spanning.mixed_lengths and self.graph.info(atom).shape[ax] != self.size:
                raise SplitFailure("axis sizes do not match", eqn)  # else: add checks
            self.axis_of[atom] = ax
            self.queue.append(atom)
        elif prev != ax:
            raise SplitFailure(f"a value is needed split along axes {prev} and {ax} at once", eqn)

    def add(self, index: int, m: Mapping | Sink) -> None:
        """Equation ``index`` joins the region, mapping the axis as ``m`` says."""
        eqn = self.graph.eqns[index]
        if index in self.maps:
            if self.maps[index] != m:
                raise SplitFailure("the axis reaches this operation in two ways", eqn)
            return
        if isinstance(m, Mapping):
            self.spanning.admit(eqn, m)
        self._check_direction(eqn, m)
        self.maps[index] = m
        for atom, ax in zip(eqn.invars, m.ins):
            self.assign(atom, ax, index)
        if isinstance(m, Mapping):
            after = running_along(eqn, m) is not None  # a scan's final carry: after the loop
            for atom, ax in zip(eqn.outvars, m.outs):
                if ax is None and not after:
                    raise SplitFailure("a result loses the split axis", eqn)
                if ax is not None:
                    self.assign(atom, ax, index)

    def _check_direction(self, eqn: JaxprEqn, m: Mapping | Sink) -> None:
        """A region's loop visits its chunks in one order: its scans along the axis must all
        run forward or all in reverse. One that runs the other way stops the axis there (a
        NoRule: the region may still close without it)."""
        run = running_along(eqn, m) if isinstance(m, Mapping) else None
        if run is None:
            return
        reverse = run.reverse(eqn)
        if self.reverse is not None and self.reverse != reverse:
            raise NoRule("scans along the split axis run in both directions")
        self.reverse = reverse

    def propagate(self) -> None:
        """Carry the axis to producers (cheap or large ones) and consumers until it stops."""
        eqns = self.graph.eqns
        while self.queue:
            var = self.queue.popleft()
            ax = self.axis_of[var]
            info = self.graph.info(var)
            p = info.producer
            if p is not None and p not in self.maps and self._pulls(p, info.bytes):
                side = ("out", list(eqns[p].outvars).index(var))
                self._try(p, side, ax, self.stopped_back, var)
            for c in info.consumers:
                if c not in self.maps:
                    pos = next(k for k, a in enumerate(eqns[c].invars) if a is var)
                    self._try(c, ("in", pos), ax, self.stopped_fwd, var)

    def _pulls(self, producer: int, nbytes: int) -> bool:
        """Whether the producer of a region value joins: cheap to recompute, or its result is
        too large to keep whole."""
        return self.graph.eqns[producer].primitive.name in CHEAP or nbytes > self.small

    def _try(self, i: int, side: tuple[str, int], ax: int, stopped: dict, var: Var) -> None:
        eqn = self.graph.eqns[i]
        if i in self.left_out:
            stopped[var] = self.left_out[i]
            return
        try:
            self.add(i, axis_map(eqn, side, ax, self.ctx))
        except NoRule as err:
            stopped[var] = SplitFailure(str(err), eqn, err.inherent)

    def mapped_results(self) -> set[Var]:
        eqns = self.graph.eqns
        return {
            o
            for i, m in self.maps.items()
            if isinstance(m, Mapping)
            for o, ax in zip(eqns[i].outvars, m.outs)
            if ax is not None
        }

    def hand_back(self, large: int) -> set[Var]:
        """Region values needed whole are computed before the loop where they are small."""
        produced = self.mapped_results()
        for var, user in self.whole_uses:
            if var in produced:
                handed = _hand_back(self.graph, self.maps, var, large)
                if handed is None:
                    raise SplitFailure(
                        "a value computed per chunk is needed whole", self.graph.eqns[user]
                    )
                for p in handed:  # computed once before the loop, sliced where read per chunk
                    del self.maps[p]
                produced = self.mapped_results()
        return produced


def grow(
    graph: Graph,
    seed: Var,
    axis: int,
    small: int,
    large: int,
    ctx: RuleContext = PLAIN,
    sliced_large: int | None = None,
    spanning: Spanning = PLAIN_SPAN,
) -> Region:
    """The region splitting ``seed`` along ``axis`` on the span ``spanning`` grows (its own
    chunks, or a strategy's: :mod:`memsafe.split.span`), its split rules told ``ctx`` as
    ``spanning`` adjusts it (replays tried, say); raises :class:`SplitFailure`.

    Producers of values over ``small`` bytes are pulled into the region even when they are not
    cheap to recompute; values the region reads or writes in full must stay under ``large``.
    Where ``sliced_large`` is given (smaller than ``large``), a value computed outside and read
    chunk by chunk that is larger than it must also be smaller than ``seed``: one as large as
    the seed is whole in memory at any chunk size, so the region saves at most what it computes
    from it (the pointwise tail of an FFT, split alone, held the FFT's result whole beside its
    chunks and kept the scheduling pass from sequencing the FFTs).
    Every consumer of a sliced input joins the region when the axis can pass through it, so
    values that read the same input along the same axis share one loop.

    An equation the axis passes through may still read another large value whole (a loop over
    layers whose body reads a large constant). Such a region cannot run; it is grown again with
    those equations left out, where the axis then stops (at most ``policy.SPLIT.max_left_out``).
    """
    left_out: dict[int, SplitFailure] = {}
    ctx = spanning.context(ctx)
    while True:
        try:
            return _grow(graph, seed, axis, small, large, left_out, ctx, sliced_large, spanning)
        except _ReadsWhole as err:
            if (
                err.users <= left_out.keys()
                or len(left_out.keys() | err.users) > policy.SPLIT.max_left_out
            ):
                raise err.failure from None
            left_out.update(dict.fromkeys(err.users, err.failure))


class _ReadsWhole(Exception):
    """Region equations ``users`` read a large value whole (``failure`` says which)."""

    def __init__(self, failure: SplitFailure, users: frozenset[int]) -> None:
        self.failure, self.users = failure, users


def _grow(
    graph: Graph,
    seed: Var,
    axis: int,
    small: int,
    large: int,
    left_out: dict[int, SplitFailure],
    ctx: RuleContext,
    sliced_large: int | None,
    spanning: Spanning,
) -> Region:
    n = graph.info(seed).shape[axis]
    g = _Growth(graph, n, small, ctx, spanning, left_out=dict(left_out))
    g.assign(seed, axis, graph.info(seed).producer or 0)
    g.propagate()
    produced = g.hand_back(large)
    sliced = {v for v in g.axis_of if v not in produced}
    whole = {v for v, _ in g.whole_uses}
    if sliced_large is not None:
        large_read = {v for v in sliced if graph.info(v).bytes > sliced_large}
        _check_inputs(g, large_read, set(), graph.info(seed).bytes - 1)
    _check_inputs(g, sliced, whole, large)
    surviving = _surviving(g, produced, large)
    _check_saves(g, seed, produced, surviving)
    stage = _assign_stages(graph, g.maps, frozenset(produced))
    size, span = spanning.span(graph, g.maps, g.axis_of, surviving, g.size)
    return Region(
        seed, axis, size, g.maps, g.axis_of, frozenset(produced),
        tuple(_in_order(graph, sliced)), tuple(_in_order(graph, whole)), tuple(surviving), stage,
        span,
    )  # fmt: skip


def _check_inputs(g: _Growth, sliced: set[Var], whole: set[Var], large: int) -> None:
    """Values computed outside and read by the region must be small (checked in program order,
    so that a refusal names the same value in every process)."""
    eqns = g.graph.eqns
    for var in _in_order(g.graph, sliced):
        info = g.graph.info(var)
        if info.producer is not None and info.bytes > large:
            raise g.stopped_back.get(var) or SplitFailure(
                "a large value outside the region would be read in full", eqns[info.producer]
            )
    for var in _in_order(g.graph, whole):
        info = g.graph.info(var)
        if info.producer is not None and info.bytes > large:
            failure = SplitFailure(
                f"needs a large value whole ({info.bytes} bytes)", eqns[info.producer]
            )
            raise _ReadsWhole(failure, frozenset(u for v, u in g.whole_uses if v is var))


def _in_order(graph: Graph, values: set[Var]) -> list[Var]:
    """``values`` in program order: constants and arguments first, in their order, then the
    others by producer and result position (never by id: sets of ``Var`` iterate by id)."""
    jaxpr = graph.closed.jaxpr
    leaves = {v: k for k, v in enumerate((*jaxpr.constvars, *jaxpr.invars))}

    def key(var: Var) -> tuple[int, int]:
        p = graph.info(var).producer
        return (-1, leaves[var]) if p is None else (p, list(graph.eqns[p].outvars).index(var))

    return sorted(values, key=key)


def _surviving(g: _Growth, produced: set[Var], large: int) -> list[Var]:
    """Region values needed outside it (written chunk by chunk); large ones only as outputs."""
    out: list[Var] = []
    for var in _in_order(g.graph, produced):
        info = g.graph.info(var)
        outside = [c for c in info.consumers if c not in g.maps]
        if not outside and not info.is_output:
            continue
        if info.bytes > large and not info.is_output:
            raise g.stopped_fwd.get(var) or SplitFailure(
                "a large result is needed outside the region", g.graph.eqns[outside[0]]
            )
        out.append(var)
    return out


def _check_saves(g: _Growth, seed: Var, produced: set[Var], surviving: list[Var]) -> None:
    """The seed must be computed in chunks, and splitting must save memory."""
    eqns, info = g.graph.eqns, g.graph.info(seed)
    if seed not in produced:
        raise g.stopped_back.get(seed) or SplitFailure(
            "its producer cannot run in chunks", eqns[info.producer or 0]
        )
    written = sum(g.graph.info(v).bytes for v in surviving if not g.graph.info(v).is_output)
    if seed in surviving or written >= info.bytes:
        users = [c for c in info.consumers if c not in g.maps] or [info.producer or 0]
        raise g.stopped_fwd.get(seed) or SplitFailure(
            "the value is needed whole, splitting saves nothing", eqns[users[0]]
        )


def check_stores(graph: Graph, region: Region) -> None:
    """Raise SplitFailure where XLA fuses every equation of ``region`` into the kernel that
    reads its results, never storing one: such a region (the layout ops and arithmetic that
    assemble a stacked parameter's gradient from its slices' into an output) stores nothing
    the program as written stores, and its chunks add the loop's buffers (deep fuzz seed 520:
    splits of its gradient's 1 MiB pads took its attempts from 5.15 to 6.9-7.8 MB).
    Transposes count as fused (``memsafe.primitives.STREAMED``). For one device: sharded over
    a mesh, such a region still places a share of its results on each device."""
    eqns = graph.eqns
    if all(eqns[i].primitive.name in STREAMED for i in region.maps):
        raise SplitFailure(
            "XLA fuses every operation of its region into what reads the results, storing "
            "none of its values: splitting saves nothing",
            eqns[graph.info(region.seed).producer or 0],
            inherent=True,
        )


def _hand_back(
    graph: Graph, maps: dict[int, Mapping | Sink], var: Var, large: int
) -> set[int] | None:
    """The region equations producing ``var`` from values outside the region, when none of
    their results is large: run before the loop instead, they give ``var`` whole (normalized
    rows that one side of ``z @ z.T`` reads per chunk and the other whole, an index array two
    gathers share). None if ``var`` needs a sink's result or a large value."""
    chain: set[int] = set()
    stack = [var]
    while stack:
        v = stack.pop()
        p = graph.info(v).producer
        if p is None or p not in maps or p in chain:
            continue
        if isinstance(maps[p], Sink) or graph.info(v).bytes > large:
            return None
        chain.add(p)
        stack.extend(a for a in graph.eqns[p].invars if is_var(a))
    return chain


class _Depends(dict):
    """:func:`region_depends`'s answer: a value computed before the region, not stored, depends
    on nothing (``get`` gives None, ``[]`` an empty set)."""

    def __missing__(self, var: Var) -> frozenset[int]:
        return _NOTHING


_NOTHING: frozenset[int] = frozenset()


def region_depends(graph: Graph, maps: dict[int, Any]) -> dict[Var, set[int]]:
    """For every value: the region equations whose results it depends on (a region value depends
    on its own producer only; values computed before the region depend on nothing). The sets
    are shared between values (a value that depends on what one operand does shares its set):
    read them, never change them."""
    depends: dict[Var, Any] = _Depends()
    if not maps:
        return depends
    eqns = graph.eqns
    for i in range(min(maps), len(eqns)):
        eqn = eqns[i]
        if i in maps:
            for o in eqn.outvars:
                depends[o] = {i}
            continue
        acc: Any = _NOTHING
        for atom in eqn.invars:
            got = depends.get(atom) if is_var(atom) else None
            if not got or got is acc:
                continue
            acc = got if not acc else acc | got
        for o in eqn.outvars:
            depends[o] = acc
    return depends


def _assign_stages(
    graph: Graph, maps: dict[int, Mapping | Sink], produced: frozenset[Var]
) -> dict[int, int]:
    """Stage of each region equation: one more than any region result its outside inputs need."""
    eqns = graph.eqns
    depends = region_depends(graph, maps)
    stage: dict[int, int] = {}
    for i in sorted(maps):
        s = 0
        for atom in eqns[i].invars:
            if not is_var(atom):
                continue
            if atom in produced:
                p = graph.info(atom).producer
                if p is not None and p in maps:
                    s = max(s, stage[p])
            else:
                for d in depends.get(atom, ()):
                    s = max(s, stage[d] + 1)
        if s >= policy.SPLIT.max_stages:
            raise SplitFailure(
                f"needs more than {policy.SPLIT.max_stages} passes over the axis", eqns[i]
            )
        stage[i] = s
    return stage
