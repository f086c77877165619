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

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from memsafe._jax import JaxprEqn, Literal, Var, source_line
from memsafe.graph import Graph
from memsafe.primitives import CHEAP
from memsafe.split.registry import Mapping, NoRule, axis_map
from memsafe.split.sinks import Sink

#: Most loops a region may be staged into (each stage recomputes the region's shared prefix).
MAX_STAGES = 4


@dataclass
class SplitFailure(Exception):
    """Why a value cannot be split along an axis: the stopping equation and the reason."""

    reason: str
    eqn: JaxprEqn | None = None

    @property
    def operation(self) -> str:
        return self.eqn.primitive.name if self.eqn is not None else "split"

    @property
    def where(self) -> str:
        return source_line(self.eqn) if self.eqn is not None else ""

    def __str__(self) -> str:
        return f"{self.operation}: {self.reason}"


@dataclass
class Region:
    """Equations that run chunk by chunk along a split dimension of length ``size``."""

    seed: Var
    seed_axis: int
    size: int
    maps: dict[int, Mapping | Sink]  # region equation index -> how the axis maps through it
    axis_of: dict[Var, int]  # split axis of every region value and sliced leaf
    produced: set[Var]  # values computed inside the region
    sliced: set[Var]  # outside values sliced per chunk
    whole: set[Var]  # outside values used whole
    surviving: list[Var]  # region values needed outside: written chunk by chunk into full buffers
    stage: dict[int, int] = field(default_factory=dict)
    online: Any = None  # memsafe.split.online.OnlinePlan when the stages merge into one loop

    @property
    def eqns(self) -> list[int]:
        return sorted(self.maps)

    @property
    def sinks(self) -> dict[int, Sink]:
        return {i: m for i, m in self.maps.items() if isinstance(m, Sink)}

    @property
    def n_stages(self) -> int:
        return 1 + max(self.stage.values(), default=0)

    def stage_eqns(self, graph: Graph, k: int) -> list[int]:
        """Equations loop ``k`` evaluates: its sinks and surviving outputs, and their ancestors."""
        eqns = graph.eqns
        surviving = set(self.surviving)
        targets = [
            i
            for i, m in self.maps.items()
            if self.stage[i] == k
            and (isinstance(m, Sink) or any(o in surviving for o in eqns[i].outvars))
        ]
        need: set[int] = set()
        stack = list(targets)
        while stack:
            i = stack.pop()
            if i in need:
                continue
            need.add(i)
            for atom in eqns[i].invars:
                if isinstance(atom, Var) and atom in self.produced:
                    p = graph.info(atom).producer
                    if p is not None and p in self.maps:
                        stack.append(p)
        return sorted(need)

    def stage_outputs(self, graph: Graph, k: int) -> list[Var]:
        """Values loop ``k`` hands to the rest of the program."""
        eqns = graph.eqns
        surviving = set(self.surviving)
        outs: list[Var] = []
        for i in sorted(self.maps):
            if self.stage[i] != k:
                continue
            if isinstance(self.maps[i], Sink):
                outs.extend(eqns[i].outvars)
            else:
                outs.extend(o for o in eqns[i].outvars if o in surviving)
        return outs


def _is_var(atom: Any) -> bool:
    return isinstance(atom, Var) and not isinstance(atom, Literal)


def grow(graph: Graph, seed: Var, axis: int, small: int, large: int) -> Region:
    """The region splitting ``seed`` along ``axis``; raises :class:`SplitFailure`.

    Producers of values over ``small`` bytes are pulled into the region even when they are not
    cheap to recompute; values the region reads or writes in full must stay under ``large``.
    Every consumer of a sliced input joins the region when the axis can pass through it, so
    values that read the same input along the same axis share one loop.
    """
    eqns = graph.eqns
    size = graph.info(seed).shape[axis]
    maps: dict[int, Mapping | Sink] = {}
    axis_of: dict[Var, int] = {}
    whole_uses: list[tuple[Var, int]] = []
    queue: deque[Var] = deque()
    stopped_back: dict[Var, SplitFailure] = {}
    stopped_fwd: dict[Var, SplitFailure] = {}

    def assign(atom: Any, ax: int | None, user: int) -> None:
        if not _is_var(atom):
            if ax is not None:
                raise SplitFailure("a literal cannot carry the split axis", eqns[user])
            return
        if ax is None:
            whole_uses.append((atom, user))
            return
        prev = axis_of.get(atom)
        if prev is None:
            if graph.info(atom).shape[ax] != size:
                raise SplitFailure("axis sizes do not match", eqns[user])
            axis_of[atom] = ax
            queue.append(atom)
        elif prev != ax:
            raise SplitFailure(
                f"a value is needed split along axes {prev} and {ax} at once", eqns[user]
            )

    def add(index: int, m: Mapping | Sink) -> None:
        if index in maps:
            if maps[index] != m:
                raise SplitFailure("the axis reaches this operation in two ways", eqns[index])
            return
        maps[index] = m
        eqn = eqns[index]
        for atom, ax in zip(eqn.invars, m.ins):
            assign(atom, ax, index)
        if isinstance(m, Mapping):
            for atom, ax in zip(eqn.outvars, m.outs):
                if ax is None:
                    raise SplitFailure("a result loses the split axis", eqn)
                assign(atom, ax, index)

    assign(seed, axis, graph.info(seed).producer or 0)
    while queue:
        var = queue.popleft()
        ax = axis_of[var]
        info = graph.info(var)
        p = info.producer
        if p is not None and p not in maps:
            eqn = eqns[p]
            if eqn.primitive.name in CHEAP or info.bytes > small:
                try:
                    add(p, axis_map(eqn, ("out", list(eqn.outvars).index(var)), ax))
                except NoRule as err:
                    stopped_back[var] = SplitFailure(str(err), eqn)
        for c in info.consumers:
            if c in maps:
                continue
            eqn = eqns[c]
            pos = next(k for k, a in enumerate(eqn.invars) if a is var)
            try:
                add(c, axis_map(eqn, ("in", pos), ax))
            except NoRule as err:
                stopped_fwd[var] = SplitFailure(str(err), eqn)

    def mapped_results() -> set[Var]:
        return {o for i in maps if isinstance(maps[i], Mapping) for o in eqns[i].outvars}

    produced = mapped_results()
    for var, user in whole_uses:
        if var in produced:
            handed = _hand_back(graph, maps, var, large)
            if handed is None:
                raise SplitFailure("a value computed per chunk is needed whole", eqns[user])
            for p in handed:  # computed once before the loop, sliced where read per chunk
                del maps[p]
            produced = mapped_results()
    sliced = {v for v in axis_of if v not in produced}
    whole = {v for v, _ in whole_uses}
    for var in sliced:
        info = graph.info(var)
        if info.producer is not None and info.bytes > large:
            why = stopped_back.get(var) or SplitFailure(
                "a large value outside the region would be read in full", eqns[info.producer]
            )
            raise why
    for var in whole:
        info = graph.info(var)
        if info.producer is not None and info.bytes > large:
            raise SplitFailure(
                f"needs a large value whole ({info.bytes} bytes)", eqns[info.producer]
            )
    surviving: list[Var] = []
    for var in sorted(produced, key=lambda v: graph.info(v).producer or 0):
        info = graph.info(var)
        outside = [c for c in info.consumers if c not in maps]
        if not outside and not info.is_output:
            continue
        if info.bytes > large and not info.is_output:
            raise stopped_fwd.get(var) or SplitFailure(
                "a large result is needed outside the region", eqns[outside[0]]
            )
        surviving.append(var)
    for v in [seed]:
        if v not in produced:
            raise stopped_back.get(v) or SplitFailure(
                "its producer cannot run in chunks", eqns[graph.info(v).producer or 0]
            )
    written = sum(graph.info(v).bytes for v in surviving if not graph.info(v).is_output)
    for v in [seed]:
        if v in surviving or written >= graph.info(v).bytes:
            info = graph.info(v)
            users = [c for c in info.consumers if c not in maps] or [info.producer or 0]
            raise stopped_fwd.get(v) or SplitFailure(
                "the value is needed whole, splitting saves nothing", eqns[users[0]]
            )
    region = Region(seed, axis, size, maps, axis_of, produced, sliced, whole, surviving)
    _assign_stages(graph, region)
    return region


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
        stack.extend(a for a in graph.eqns[p].invars if _is_var(a))
    return chain


def region_depends(graph: Graph, maps: dict[int, Any]) -> dict[Var, set[int]]:
    """For every value: the region equations whose results it depends on (a region value depends
    on its own producer only; values computed before the region depend on nothing)."""
    depends: dict[Var, set[int]] = {}
    for i, eqn in enumerate(graph.eqns):
        if i in maps:
            for o in eqn.outvars:
                depends[o] = {i}
            continue
        acc: set[int] = set()
        for atom in eqn.invars:
            if _is_var(atom):
                acc |= depends.get(atom, set())
        for o in eqn.outvars:
            depends[o] = acc
    return depends


def _assign_stages(graph: Graph, region: Region) -> None:
    """Stage of each region equation: one more than any region result its outside inputs need."""
    eqns = graph.eqns
    maps = region.maps
    depends = region_depends(graph, maps)
    stage: dict[int, int] = {}
    for i in sorted(maps):
        s = 0
        for atom in eqns[i].invars:
            if not _is_var(atom):
                continue
            if atom in region.produced:
                p = graph.info(atom).producer
                if p is not None and p in maps:
                    s = max(s, stage[p])
            else:
                for d in depends.get(atom, ()):
                    s = max(s, stage[d] + 1)
        if s >= MAX_STAGES:
            raise SplitFailure(f"needs more than {MAX_STAGES} passes over the axis", eqns[i])
        stage[i] = s
    region.stage = stage
