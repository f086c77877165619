"""Repeats: blocks of equations written one after another that compute the same thing on other
inputs (the layers of a Python loop over a list of parameters, and the backward of each layer in
its gradient), found with the dataflow that makes them one loop body.

A run of ``count`` blocks of ``period`` equations is a loop when every block reads, at each
operand, the same kind of value: a value of its own block (the same one in every block), a value
of the block before (a carry; the first block reads the carry's initial value from outside), a
value from outside the run (the same one in every block: a constant; or one per block: scanned),
or the same literal. Block boundaries are placed where the carries are narrowest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np

from memsafe import policy, primitives
from memsafe._jax import (
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    Var,
    is_var,
    jaxprs_in_params,
    nbytes_of_aval,
)
from memsafe.graph.graph import Graph, memo


@dataclass(frozen=True)
class Run:
    """Equations ``start .. start + period * count``: ``count`` blocks of ``period``."""

    start: int
    period: int
    count: int

    @property
    def stop(self) -> int:
        return self.start + self.period * self.count

    def locate(self, index: int) -> tuple[int, int]:
        """(block, position in the block) of equation ``index`` of the run."""
        return divmod(index - self.start, self.period)

    def eqn(self, block: int, position: int) -> int:
        return self.start + block * self.period + position


# -- what a block's operand reads -------------------------------------------------------------


class Frame(Protocol):
    """A loop body's values while it runs one block (see each source's ``value``)."""

    def inner(self, at: Inner) -> Any: ...
    def carried(self, at: Inner) -> Any: ...
    def shared(self, var: Var) -> Any: ...
    def scanned(self, src: Scanned) -> Any: ...


@dataclass(frozen=True)
class Inner:
    """A value the same block computes: result ``out`` of its equation at ``position``."""

    position: int
    out: int

    def value(self, frame: Frame) -> Any:
        return frame.inner(self)


@dataclass(frozen=True)
class Carried:
    """The value the block before computed at ``source`` (the first block reads ``init``)."""

    source: Inner
    init: Var

    def value(self, frame: Frame) -> Any:
        return frame.carried(self.source)


@dataclass(frozen=True)
class Shared:
    """The same value from outside the run in every block."""

    var: Var

    def value(self, frame: Frame) -> Any:
        return frame.shared(self.var)


@dataclass(frozen=True)
class Scanned:
    """One value from outside the run per block, in block order."""

    vars: tuple[Var, ...]

    def value(self, frame: Frame) -> Any:
        return frame.scanned(self)


@dataclass(frozen=True)
class Fixed:
    """The same literal in every block (equal by dtype and bytes, NaN included)."""

    key: tuple[str, bytes]
    literal: Any = field(compare=False, hash=False)

    def value(self, frame: Frame) -> Any:
        return self.literal


Source = Inner | Carried | Shared | Scanned | Fixed
S = TypeVar("S", Inner, Carried, Shared, Scanned, Fixed)


@dataclass(frozen=True)
class Loop:
    """A run read as a loop.

    Attributes:
        run: the equations.
        body: the first block's equations (every block binds the same primitives and params).
        reads: for each body equation, what each of its operands reads.
        carries: the carries' sources, each with its initial value (one per source).
        read_outside: the values of the run something after it reads, as (block, source).
    """

    run: Run
    body: tuple[JaxprEqn, ...]
    reads: tuple[tuple[Source, ...], ...]
    carries: tuple[Carried, ...]
    read_outside: tuple[tuple[int, Inner], ...]

    def var(self, eqns: Sequence[JaxprEqn], block: int, at: Inner) -> Var:
        """The variable of block ``block`` at ``at``."""
        return eqns[self.run.eqn(block, at.position)].outvars[at.out]

    def carry_bytes(self) -> int:
        return sum(nbytes_of_aval(c.init.aval) for c in self.carries)

    def sources(self, kind: type[S]) -> list[S]:
        """The distinct sources of type ``kind`` the body reads, in the order it reads them."""
        return list(dict.fromkeys(s for row in self.reads for s in row if isinstance(s, kind)))


# -- finding runs -----------------------------------------------------------------------------


def literal_key(value: Any) -> tuple[str, bytes]:
    a = np.asarray(value)
    return a.dtype.str, a.tobytes()


def _aval_key(atom: Any) -> tuple[Any, ...]:
    aval = atom.aval
    dtype = getattr(aval, "dtype", None)
    return (tuple(getattr(aval, "shape", ())), str(aval) if dtype is None else dtype,
            bool(getattr(aval, "weak_type", False)))  # fmt: skip


def _param_key(value: Any) -> Any:
    try:
        hash(value)
        return value
    except TypeError:
        return repr(value)


def _operand_key(atom: Any) -> tuple[Any, ...]:
    return ("lit", literal_key(atom.val)) if isinstance(atom, Literal) else _aval_key(atom)


def _eqn_key(eqn: JaxprEqn, ins: tuple[Any, ...]) -> tuple[Any, ...]:
    """An equation's primitive, params (sub-programs by :func:`program_key`), ``ins`` (what
    its operands are) and result types."""
    subs = tuple(program_key(j) for j in jaxprs_in_params(eqn))
    params = tuple(
        (k, _param_key(v)) for k, v in sorted(eqn.params.items()) if k not in _PROGRAM_PARAMS
    )
    return (eqn.primitive.name, params, subs, ins, tuple(_aval_key(o) for o in eqn.outvars))


def program_key(jaxpr: Any) -> tuple[Any, ...]:
    """A sub-program as a value two equal programs share, whatever their variables are called:
    its inputs' types, each equation's :func:`signature` with its operands numbered by the
    value they read (in order of definition), and the outputs read. Computed once per jaxpr
    object (:func:`memsafe.graph.graph.memo`): the blocks of a Python loop often hold the same
    sub-program."""
    kept = memo(jaxpr, "program_key")
    if "key" not in kept:
        kept["key"] = _program_key(jaxpr)
    return kept["key"]


def _program_key(jaxpr: Any) -> tuple[Any, ...]:
    number: dict[Var, int] = {}
    for v in (*jaxpr.constvars, *jaxpr.invars):
        number.setdefault(v, len(number))

    def read(atom: Any) -> tuple[Any, ...]:
        if isinstance(atom, Literal):
            return ("lit", literal_key(atom.val))
        return ("var", number.get(atom, -1), _aval_key(atom))

    eqns = []
    for eqn in jaxpr.eqns:
        eqns.append(_eqn_key(eqn, tuple(read(a) for a in eqn.invars)))
        for v in eqn.outvars:
            number.setdefault(v, len(number))
    return (
        tuple(_aval_key(v) for v in jaxpr.constvars),
        tuple(_aval_key(v) for v in jaxpr.invars),
        tuple(eqns),
        tuple(read(a) for a in jaxpr.outvars),
        tuple(sorted(map(str, getattr(jaxpr, "effects", ())))),
    )


def signature(eqn: JaxprEqn) -> tuple[Any, ...]:
    """What two equations must share to be the same step of two blocks: primitive, params
    (sub-programs by :func:`program_key`), operand and result types, literals."""
    return _eqn_key(eqn, tuple(_operand_key(a) for a in eqn.invars))


_PROGRAM_PARAMS = {"jaxpr", "branches", "cond_jaxpr", "body_jaxpr", "call_jaxpr", "fun_jaxpr"}


def _periods(ids: np.ndarray) -> list[int]:
    """Gaps between consecutive equations of the same signature, long enough to be a block."""
    last: dict[int, int] = {}
    gaps: set[int] = set()
    for i, s in enumerate(ids.tolist()):
        if s in last and policy.REWRITE.period_min <= i - last[s] <= len(ids) // 2:
            gaps.add(i - last[s])
        last[s] = i
    return sorted(gaps)


def _stretches(ids: np.ndarray, p: int) -> list[tuple[int, int]]:
    """(start, length) of each stretch where equation i matches equation i + p, at least p
    long (two blocks or more)."""
    same = np.concatenate([[False], ids[:-p] == ids[p:], [False]])
    edges = np.flatnonzero(np.diff(same.astype(np.int8)))
    starts, ends = edges[0::2], edges[1::2]
    return [(int(a), int(b - a)) for a, b in zip(starts, ends) if b - a >= p]


def candidates(eqns: Sequence[JaxprEqn]) -> list[tuple[int, int, int, int]]:
    """(first possible start, slack, period, count) of repeated stretches, most equations
    covered first, then shortest period."""
    table: dict[tuple[Any, ...], int] = {}
    ids = np.array([table.setdefault(signature(e), len(table)) for e in eqns], dtype=np.int64)
    found = []
    for p in _periods(ids):
        for a, m in _stretches(ids, p):
            count = m // p + 1
            found.append((a, m - (count - 1) * p, p, count))
    return sorted(found, key=lambda c: (-c[2] * c[3], c[2]))


# -- reading a run as a loop ------------------------------------------------------------------


@dataclass(frozen=True)
class _Before:
    """An operand read from the block before, at ``at``."""

    at: Inner


def _where(graph: Graph, run: Run, block: int, atom: Any) -> Source | _Before | None:
    """Where block ``block``'s operand ``atom`` comes from: a literal, a value of the block, of
    the block before, from outside the run (as :class:`Shared`, for now); None for a value of a
    block before that."""
    if isinstance(atom, Literal):
        return Fixed(literal_key(atom.val), atom.val)
    i = graph.info(atom).producer
    if i is None or not run.start <= i < run.stop:
        return Shared(atom)
    b, j = run.locate(i)
    at = Inner(j, list(graph.eqns[i].outvars).index(atom))
    return at if b == block else _Before(at) if b == block - 1 else None


def _source(seen: list[Source | _Before | None]) -> Source | None:
    """What one operand reads across the blocks (where each block reads it from), or None
    where no loop reads so."""
    first, rest = seen[0], seen[1:]
    if isinstance(first, Fixed | Inner | Shared) and all(s == first for s in rest):
        return first
    if isinstance(first, Shared) and all(isinstance(s, _Before) and s == rest[0] for s in rest):
        return Carried(rest[0].at, first.var)
    if all(isinstance(s, Shared) for s in seen):
        return Scanned(tuple(s.var for s in seen))
    return None


def read_as_loop(graph: Graph, run: Run) -> Loop | None:
    """``run`` as a loop, or None where some operand reads otherwise (or has effects)."""
    eqns = graph.eqns
    body = tuple(eqns[run.start : run.start + run.period])
    if any(e.effects for e in body):
        return None
    reads, inits = [], {}
    for j, eqn in enumerate(body):
        row = []
        for a in range(len(eqn.invars)):
            atoms = [eqns[run.eqn(b, j)].invars[a] for b in range(run.count)]
            src = _source([_where(graph, run, b, x) for b, x in enumerate(atoms)])
            if src is None or (isinstance(src, Carried) and inits.setdefault(src.source, src.init)
                               is not src.init):  # fmt: skip
                return None
            row.append(src)
        reads.append(tuple(row))
    carries = tuple(Carried(s, v) for s, v in inits.items())
    return Loop(run, body, tuple(reads), carries, _read_outside(graph, run))


def _read_outside(graph: Graph, run: Run) -> tuple[tuple[int, Inner], ...]:
    """(block, place) of the run's values that the program's outputs or later equations read."""
    out = []
    for i in range(run.start, run.stop):
        for o, v in enumerate(graph.eqns[i].outvars):
            info = graph.info(v)
            if info.is_output or any(c >= run.stop for c in info.consumers):
                b, j = run.locate(i)
                out.append((b, Inner(j, o)))
    return tuple(out)


#: For each equation of a program, the producer (None for an input) of each variable it reads,
#: with the variable: what :func:`_crossing` looks up over and over.
Operands = list[list[tuple[int | None, Var]]]


def _operands(graph: Graph) -> Operands:
    info = graph.info
    return [[(info(v).producer, v) for v in e.invars if is_var(v)] for e in graph.eqns]


def _crossing(graph: Graph, run: Run, operands: Operands | None = None) -> int:
    """Bytes of the first block's values the second block reads (a loop's carries)."""
    operands = _operands(graph) if operands is None else operands
    seen: set[Var] = set()
    first, stop = run.start, run.start + run.period
    for i in range(stop, run.start + 2 * run.period):
        for p, v in operands[i]:
            if p is not None and first <= p < stop:
                seen.add(v)
    return sum(nbytes_of_aval(v.aval) for v in seen)


def _narrowest(graph: Graph, runs: list[Run], operands: Operands | None = None) -> tuple[Loop, ...]:
    """Of ``runs`` (the same stretch at other block boundaries), those that read as loops with
    the narrowest carries."""
    operands = _operands(graph) if operands is None else operands
    by_width: dict[int, list[Run]] = {}
    for r in runs:
        by_width.setdefault(_crossing(graph, r, operands), []).append(r)
    for width in sorted(by_width):
        found = tuple(lp for lp in (read_as_loop(graph, r) for r in by_width[width]) if lp)
        if found:
            return found
    return ()


def loops(graph: Graph) -> list[tuple[Loop, ...]]:
    """For each repeated stretch of two blocks or more (most equations first, not overlapping
    one taken before), the runs over it that read as loops with the narrowest carries: block
    boundaries that tie (two residual additions per layer) are all returned, for the caller to
    choose among. In program order."""
    taken: list[tuple[Loop, ...]] = []
    spans: list[Run] = []
    operands: Operands | None = None
    for first, slack, period, count in candidates(graph.eqns):
        span = Run(first, period * count + slack, 1)
        if any(_overlaps(span, t) for t in spans):
            continue
        operands = _operands(graph) if operands is None else operands
        runs = [Run(first + s, period, count) for s in range(slack + 1)]
        found = _narrowest(graph, runs, operands)
        if found:
            taken.append(found)
            spans.append(span)
    return sorted(taken, key=lambda alts: alts[0].run.start)


def _overlaps(a: Run, b: Run) -> bool:
    return a.start < b.stop and b.start < a.stop


# -- an order in which repeats show -----------------------------------------------------------


def _movable(eqn: JaxprEqn) -> bool:
    """Whether :func:`sunk` moves ``eqn``: cheap work (layout, arithmetic) or an in-place update,
    with no effects and no program of its own."""
    name = eqn.primitive.name
    if eqn.effects or any(True for _ in jaxprs_in_params(eqn)):
        return False
    return name in primitives.CHEAP or name in primitives.UPDATES


def sunk(closed: ClosedJaxpr) -> ClosedJaxpr:
    """``closed`` with the layout equations that read its inputs alone (through other such
    equations) moved to its start, and the cheap equations (and in-place updates) that only its
    results read, through other such equations alone, moved to its end; the others in their
    order. ``closed`` itself where nothing moves.

    Each layer of a Python loop over a stacked parameter reads its slice (``ws[i]``), each at
    a position of its own: written in each layer's block, the slices make the blocks differ;
    moved to the start, they are values from outside the run, one per block (read by a rolled
    scan as the parameter whole, sliced per iteration).

    The gradient of a stacked parameter read a slice per layer in a Python loop sums (or writes
    in place) one piece per layer into one buffer, each piece at its own position: the pads and
    updates that place the pieces differ from layer to layer (their positions are parameters and
    literals), and written in the middle of each layer's backward they cut the run of repeated
    blocks in pieces too short to be found. The chain is read only by the results (an
    optimizer's update, itself cheap work), so moved to the end with the cheap work that only
    feeds it, it leaves the layers' blocks the same. Work read by anything else stays where it
    is (a residual connection's sum of cotangents, read by the next layer's backward). A
    program's meaning does not depend on the order of its equations (a topological order;
    equations with effects never move): only the loops found in it do."""
    graph = Graph(closed)
    eqns = closed.jaxpr.eqns
    n = len(eqns)
    # keys: (position, depth); a moved equation takes its first reader's key one step earlier
    # (the end's key where only the results read it), so that it precedes every reader it has
    keys: list[tuple[int, int]] = [(i, 0) for i in range(n)]
    early = {*closed.jaxpr.invars, *closed.jaxpr.constvars}
    for i, eqn in enumerate(eqns):  # layout of the inputs alone: first
        layout = primitives.facts(eqn.primitive.name).kind is primitives.Kind.LAYOUT
        read = [a for a in eqn.invars if is_var(a)]
        if layout and read and _movable(eqn) and all(a in early for a in read):
            early.update(eqn.outvars)
            keys[i] = (-1, i)
    for i in range(n - 1, -1, -1):
        if not _movable(eqns[i]) or keys[i][0] < 0:
            continue
        after = [keys[r] for v in eqns[i].outvars for r in graph.info(v).consumers]
        first = min(after, default=(n, 0))
        if first[0] == n:
            keys[i] = (n, first[1] - 1)
    order = sorted(range(n), key=lambda i: (keys[i], i))
    if order == list(range(n)):
        return closed
    jaxpr = closed.jaxpr.replace(eqns=[eqns[i] for i in order])
    return ClosedJaxpr(jaxpr, closed.consts)
