"""Rolling: same-shaped blocks written one after another become a ``lax.scan`` over the blocks.

A model written as a Python loop over its layers traces to one block of equations per layer, and
its gradient to one backward block per layer after them, reading each forward block's residuals
(each layer's attention probabilities). XLA keeps all of them alive at once, and on the CPU it
does not reuse buffers across recomputed segments written one after another. As a scan over the
blocks, the forward stacks the residuals and the backward scan reads them; the remat pass can
then recompute them one iteration at a time, as it does for a model written with ``lax.scan``.

A forward run and a later run of the same number of blocks that reads its values are rolled
together, where what the later run reads of the forward's is over the remat pass's share of the
budget. The backward run iterates in reverse, so it reads the forward's stacked values as they
are; parameters both runs read per block are stacked once. Blocks that differ (the first layer,
whose input is not differentiated) stay as they are.

A run whose blocks compute again, from the same operands, values computed before it (the
backward of layers each under ``jax.checkpoint``, inlined: each block recomputes its layer's
forward) is rolled alone where those values are over the same share, found or not as a loop
before it: written one after another, XLA's common-subexpression elimination merges each
recomputation with the forward and keeps them all alive; in a scan's body it cannot. Where the
program's own order rolls no forward run, the loops are looked for again with the slices of
the inputs moved to the start and the cheap work only the results read moved to the end
(:func:`memsafe.graph.repeats.sunk`), and that order is taken where it rolls more runs: each
layer's slice of a stacked parameter (``ws[i]``) and the pads or in-place updates that place
each layer's piece of its gradient, each at a position of its own, cut the forward's and the
backward's blocks otherwise. A forward run is paired with a later one that reads, as whole
stacks, its blocks' values or the carries its blocks start from (a ``jax.checkpoint`` around
each layer keeps only the layers' inputs). A scanned operand whose values are static slices of
one array is read by the scan as that array, sliced per iteration.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from memsafe import policy
from memsafe._jax import (
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    Var,
    dce,
    is_var,
    jaxprs_in_params,
    nbytes_of_aval,
    source_line,
)
from memsafe.context import PassContext
from memsafe.graph import Graph
from memsafe.graph.graph import memo
from memsafe.graph.interpret import Group, evaluate_eqns, retrace
from memsafe.graph.repeats import (
    Carried,
    Inner,
    Loop,
    Scanned,
    Shared,
    literal_key,
    loops,
    signature,
    sunk,
)
from memsafe.log import logger
from memsafe.plan import PassRecord, format_bytes


@dataclass(frozen=True)
class Stack:
    """A stacked value's key among a rewrite's values: the variables it stacks, in order."""

    vars: tuple[Var, ...]


@dataclass(frozen=True)
class Sliced:
    """A scanned operand whose variables are each a static slice of one array, of one size
    (``ws[i]``, a layer's slice of a stacked parameter), maybe reshaped: the scan reads the array
    whole and each iteration's start indices, and its body slices the array, where a stack of
    the slices would copy them (the whole parameter again)."""

    array: Var
    starts: tuple[tuple[int, ...], ...]  # per iteration, in the scan's order
    sizes: tuple[int, ...]
    shape: tuple[int, ...]  # the variables' shape

    def indices(self) -> Any:
        return np.asarray(self.starts, np.int32)

    def read(self, array: Any, start: Any) -> Any:
        """One iteration's variable, from the array and its start indices."""
        starts = [start[d] for d in range(len(self.sizes))]
        return jax.lax.dynamic_slice(array, starts, self.sizes).reshape(self.shape)


def _sliced(graph: Graph, variables: Sequence[Var]) -> Sliced | None:
    """``variables`` as slices of one array (each a unit-stride ``slice``, maybe reshaped or
    squeezed after), or None."""
    arrays, starts, sizes = set(), [], set()
    for v in variables:
        eqn = graph.producer(v)
        if eqn is not None and (
            eqn.primitive.name == "squeeze"
            or (eqn.primitive.name == "reshape" and eqn.params.get("dimensions") is None)
        ):
            eqn = graph.producer(eqn.invars[0])
        if eqn is None or eqn.primitive.name != "slice" or not is_var(eqn.invars[0]):
            return None
        if any(stride not in (None, 1) for stride in eqn.params["strides"] or ()):
            return None
        start, limit = eqn.params["start_indices"], eqn.params["limit_indices"]
        arrays.add(eqn.invars[0])
        starts.append(tuple(int(a) for a in start))
        sizes.add(tuple(int(b) - int(a) for a, b in zip(start, limit)))
    if len(arrays) != 1 or len(sizes) != 1:
        return None
    shape = tuple(variables[0].aval.shape)
    return Sliced(arrays.pop(), tuple(starts), sizes.pop(), shape)


@dataclass(frozen=True)
class Rolled:
    """A loop and the way its scan iterates: ``reverse`` for blocks in reverse program order
    (a backward pass), so iteration ``i`` runs block ``order[i]``."""

    loop: Loop
    reverse: bool

    @property
    def order(self) -> tuple[int, ...]:
        blocks = range(self.loop.run.count)
        return tuple(reversed(blocks)) if self.reverse else tuple(blocks)

    def index(self, block: int) -> int:
        return self.order.index(block)


class _Rewrite:
    """The groups that replace the rolled loops' equations, and the stacks they share."""

    def __init__(self, graph: Graph, loops: Sequence[Loop]) -> None:
        self.graph, self.eqns = graph, graph.eqns
        self.stacks: set[Stack] = set()  # given by an earlier group
        self.groups = [self._group(lp) for lp in loops]

    def _in_order(self, rolled: Rolled, vars_of_block: Any) -> Stack:
        return Stack(tuple(vars_of_block(b) for b in rolled.order))

    def _scanned(self, rolled: Rolled) -> list[Stack]:
        """The loop's scanned operands, each as the stack its scan reads."""
        return [self._in_order(rolled, s.vars.__getitem__) for s in rolled.loop.sources(Scanned)]

    def _orient(self, loop: Loop) -> Rolled:
        """Reverse where more of the loop's scanned operands are stacks given already."""
        found = {
            r: sum(s in self.stacks for s in self._scanned(Rolled(loop, r))) for r in (False, True)
        }
        return Rolled(loop, found[True] > found[False])

    def _carried_in(self, rolled: Rolled, carry: Carried) -> Stack:
        loop = rolled.loop
        return self._in_order(
            rolled, lambda b: carry.init if b == 0 else loop.var(self.eqns, b - 1, carry.source)
        )

    def _group(self, loop: Loop) -> Group:
        """The group computing ``loop``'s equations as one scan."""
        rolled = self._orient(loop)
        scanned = self._scanned(rolled)
        shared = loop.sources(Shared)
        inits = [c.init for c in loop.carries]
        # each scanned operand: a stack given by an earlier group, slices of one array (read
        # whole, sliced in the body), or its variables to stack
        sliced = [None if s in self.stacks else _sliced(self.graph, s.vars) for s in scanned]
        operands = [
            [s] if s in self.stacks else [cut.array] if cut else list(s.vars)
            for s, cut in zip(scanned, sliced)
        ]
        carried = {c.source for c in loop.carries}
        stacked = list(dict.fromkeys(at for _, at in loop.read_outside if at not in carried))
        gives, picks = self._gives(rolled, stacked, scanned, sliced)

        def run(values: list[Any]) -> list[Any]:
            consts, values = values[: len(shared)], values[len(shared) :]
            init, values = values[: len(inits)], values[len(inits) :]
            xs, arrays = [], []
            for needed, cut in zip(operands, sliced):
                part, values = values[: len(needed)], values[len(needed) :]
                arrays.append(part[0] if cut else None)
                if cut:
                    xs.append(cut.indices())
                else:
                    xs.append(part[0] if isinstance(needed[0], Stack) else jnp.stack(part))
            reads = [
                None if cut is None else functools.partial(cut.read, array)
                for cut, array in zip(sliced, arrays)
            ]
            body = _body(loop, dict(zip(shared, consts)), stacked, reads)
            final, (ys, carried) = jax.lax.scan(
                body, tuple(init), tuple(xs), reverse=rolled.reverse
            )
            results = Results(final, ys, carried, xs)
            return [pick(results) for pick in picks]

        needs = (*shared, *inits, *(v for needed in operands for v in needed))
        first = loop.run.start
        return Group(frozenset(range(first, loop.run.stop)), needs, gives, first, run)

    def _gives(
        self,
        rolled: Rolled,
        stacked: list[Inner],
        scanned: list[Stack],
        sliced: Sequence[Sliced | None],
    ) -> tuple[tuple[Any, ...], list[Pick]]:
        """What the group gives (the values read after it, and its stacks for later groups:
        those of ``stacked`` values and of the ``scanned`` operands it stacks, not those it
        slices from an array), each with how it is picked from the scan's results."""
        loop, eqns = rolled.loop, self.eqns
        carries = {c.source: k for k, c in enumerate(loop.carries)}
        gives: list[Any] = []
        picks: list[Pick] = []
        for block, at in loop.read_outside:
            gives.append(loop.var(eqns, block, at))
            picks.append(_pick(rolled, block, at, carries, stacked))
        for k, c in enumerate(loop.carries):
            gives.append(self._carried_in(rolled, c))
            picks.append(lambda r, k=k: r.carried[k])
        for n, at in enumerate(stacked):
            gives.append(self._in_order(rolled, lambda b, at=at: loop.var(eqns, b, at)))
            picks.append(lambda r, n=n: r.ys[n])
        for n, (stack, cut) in enumerate(zip(scanned, sliced)):
            if cut is None:
                gives.append(stack)
                picks.append(lambda r, n=n: r.xs[n])
        new = [(g, p) for g, p in zip(gives, picks) if g not in self.stacks]
        self.stacks.update(g for g, _ in new if isinstance(g, Stack))
        return tuple(g for g, _ in new), [p for _, p in new]


class Results(NamedTuple):
    """A rolled loop's scan: its final carries, stacked values, stacked incoming carries and
    stacked operands."""

    final: tuple[Any, ...]
    ys: tuple[Any, ...]
    carried: tuple[Any, ...]
    xs: list[Any]


#: How one value the rolled equations gave is read from their scan's results.
Pick = Callable[[Results], Any]


def _pick(
    rolled: Rolled, block: int, at: Inner, carries: dict[Inner, int], stacked: list[Inner]
) -> Pick:
    """How the value of ``block`` at ``at`` is read from the scan's results: a carry from the
    next block's incoming carries (the last block's from the final carry), any other value
    from its stack."""
    if at not in carries:
        n, i = stacked.index(at), rolled.index(block)
        return lambda r: r.ys[n][i]
    k = carries[at]
    if block == rolled.loop.run.count - 1:
        return lambda r: r.final[k]
    i = rolled.index(block + 1)
    return lambda r: r.carried[k][i]


@dataclass
class _Frame:
    """The values one iteration of a rolled loop's body reads (a :class:`repeats.Frame`)."""

    rows: Sequence[Sequence[Any]]  # each body equation's operands, as sources
    carry: dict[Inner, Any]
    consts: dict[Var, Any]
    xs: dict[Scanned, Any]
    outs: dict[int, Sequence[Any]] = field(default_factory=dict)

    def operands(self, i: int, eqn: JaxprEqn) -> list[Any]:
        """Body equation ``i``'s operands, each read from its source
        (:class:`memsafe.graph.interpret.Values`)."""
        return [src.value(self) for src in self.rows[i]]

    def define(self, i: int, eqn: JaxprEqn, outs: Sequence[Any]) -> None:
        self.outs[i] = outs

    def inner(self, at: Inner) -> Any:
        return self.outs[at.position][at.out]

    def carried(self, at: Inner) -> Any:
        return self.carry[at]

    def shared(self, var: Var) -> Any:
        return self.consts[var]

    def scanned(self, src: Scanned) -> Any:
        return self.xs[src]


def _body(
    loop: Loop,
    consts: dict[Var, Any],
    stacked: list[Inner],
    reads: Sequence[Callable[[Any], Any] | None],
) -> Callable[..., Any]:
    """The scan body of ``loop``: the first block's equations, each operand read from its
    source (a scanned one through its entry of ``reads`` where it has one: its slice of an
    array, from the iteration's start indices); it carries the carries' sources on, and stacks
    the values at ``stacked`` and the incoming carries."""
    sources = [c.source for c in loop.carries]
    scanned = loop.sources(Scanned)

    def body(carry: tuple[Any, ...], x: tuple[Any, ...]) -> tuple[Any, ...]:
        x = tuple(v if read is None else read(v) for v, read in zip(x, reads, strict=True))
        frame = _Frame(loop.reads, dict(zip(sources, carry)), consts, dict(zip(scanned, x)))
        evaluate_eqns(loop.body, range(len(loop.body)), frame)
        new = tuple(frame.inner(at) for at in sources)
        return new, (tuple(frame.inner(at) for at in stacked), carry)

    return body


def _aligned(graph: Graph, later: Loop, earlier: Loop) -> int:
    """Bytes of ``earlier``'s values that ``later`` reads as whole stacks: an operand that
    reads the same value of every block of ``earlier``, or the carry each block of ``earlier``
    starts from (its layer's input, which a ``jax.checkpoint`` around each layer keeps), in
    block order or in reverse."""
    run, total, count = earlier.run, 0, earlier.run.count
    whole = (tuple(range(count)), tuple(reversed(range(count))))
    incoming = set()
    for c in earlier.carries:
        ins = (c.init, *(earlier.var(graph.eqns, b, c.source) for b in range(count - 1)))
        incoming |= {ins, ins[::-1]}
    for src in later.sources(Scanned):
        if src.vars in incoming:
            total += sum(nbytes_of_aval(v.aval) for v in src.vars)
            continue
        producers = [graph.info(v).producer for v in src.vars]
        if any(p is None or not run.start <= p < run.stop for p in producers):
            continue
        places = {(run.locate(p)[1], list(graph.eqns[p].outvars).index(v))
                  for p, v in zip(producers, src.vars)}  # fmt: skip
        if len(places) == 1 and tuple(run.locate(p)[0] for p in producers) in whole:
            total += sum(nbytes_of_aval(v.aval) for v in src.vars)
    return total


@dataclass(frozen=True)
class Pair:
    """A loop worth rolling and the forward loop it reads or recomputes.

    Attributes:
        forward: the earlier loop; rolled too where the later one reads its residuals (None
            where it is left unrolled).
        later: the loop that reads or recomputes the forward's values.
        reads: bytes of the forward's values the later loop reads as whole stacks (residuals).
        recomputes: bytes of the values of the forward's blocks that each later block computes
            again (a ``jax.checkpoint`` around each layer), where it recomputes most of them.
    """

    forward: Loop | None
    later: Loop
    reads: int
    recomputes: int

    @property
    def loops(self) -> tuple[Loop, ...]:
        return (self.later,) if self.forward is None else (self.forward, self.later)


def _recomputes(later: Loop, earlier: Loop) -> int:
    """Bytes of the values of ``earlier``'s blocks that ``later``'s blocks compute again (by
    equation signature), where that is most of one block's values; else 0."""
    have = Counter(map(signature, later.body))
    again = whole = 0
    for e in earlier.body:
        size = sum(nbytes_of_aval(v.aval) for v in e.outvars)
        whole += size
        key = signature(e)
        if have[key] > 0:
            have[key] -= 1
            again += size
    return again * later.run.count if 2 * again >= whole else 0


def _pair(graph: Graph, earlier: tuple[Loop, ...], later: tuple[Loop, ...]) -> Pair:
    """The two loops (of the block boundaries found for each, those where the later one reads
    the most of the earlier one's values as whole stacks)."""
    reads, a, b = max(
        ((_aligned(graph, b, a), a, b) for a in earlier for b in later), key=lambda t: t[0]
    )
    return Pair(a, b, reads, _recomputes(b, a))


@dataclass
class Found:
    """What the pass reads of one program whatever the budget (kept for the search's next
    attempt at the same program, :func:`memsafe.graph.graph.memo`): its loops, the pair of
    each two of them (by their positions, found when first asked for), the bytes XLA would
    merge of each loop's values (:func:`_merged`), and the program rewritten for each choice of
    pairs (None where JAX did not take it)."""

    loops: list[tuple[Loop, ...]]
    pairs: dict[tuple[int, int], Pair] = field(default_factory=dict)
    merges: dict[int, int] = field(default_factory=dict)
    rolled: dict[tuple[tuple[int, int, bool], ...], ClosedJaxpr | None] = field(
        default_factory=dict
    )

    def pair(self, graph: Graph, e: int, k: int) -> Pair:
        if (e, k) not in self.pairs:
            self.pairs[e, k] = _pair(graph, self.loops[e], self.loops[k])
        return self.pairs[e, k]

    def merged(self, graph: Graph, k: int) -> int:
        if k not in self.merges:
            self.merges[k] = _merged(graph, self.loops[k][0])
        return self.merges[k]


def found(graph: Graph) -> Found:
    """The program's :class:`Found`, computed once per program (and rewrite policy)."""
    kept = memo(graph.closed, "roll", valid=policy.REWRITE)
    if "found" not in kept:
        kept["found"] = Found(loops(graph))
    return kept["found"]


def _sunk(closed: ClosedJaxpr) -> ClosedJaxpr:
    """:func:`memsafe.graph.repeats.sunk` of ``closed``, made once per program (and rewrite
    policy): the search's attempts find their loops in the same object again."""
    kept = memo(closed, "roll", valid=policy.REWRITE)
    if "sunk" not in kept:
        kept["sunk"] = sunk(closed)
    return kept["sunk"]


def _merged(graph: Graph, loop: Loop) -> int:
    """Bytes of the values ``loop``'s blocks compute again from the same operands as an
    equation before the loop (a ``jax.checkpoint`` around each layer recomputes its forward in
    its backward): XLA's common-subexpression elimination merges each with the earlier one and
    keeps it alive from the forward to the backward, unless the loop runs as a scan. Equations
    with effects or programs of their own are never taken for the same."""
    numbers: dict[Any, Any] = {}
    seen: dict[tuple[Any, ...], tuple[int, tuple[Any, ...]]] = {}
    run, total = loop.run, 0

    def number(atom: Any) -> Any:
        if isinstance(atom, Literal):
            return ("lit", literal_key(atom.val))
        return numbers.setdefault(atom, ("var", len(numbers)))

    for i, eqn in enumerate(graph.eqns):
        if i >= run.stop:
            break
        outs = tuple(number(v) for v in eqn.outvars)
        if eqn.effects or any(True for _ in jaxprs_in_params(eqn)):
            continue
        key = (signature(eqn), tuple(number(a) for a in eqn.invars))
        if key not in seen:
            seen[key] = (i, outs)
            continue
        first, same = seen[key]
        for v, n in zip(eqn.outvars, same):
            numbers[v] = n
        if first < run.start <= i:
            total += sum(nbytes_of_aval(v.aval) for v in eqn.outvars)
    return total


def _chosen(graph: Graph, budget: int) -> list[tuple[tuple[int, int, bool], Pair]]:
    """:func:`chosen`'s pairs, each with its key among the program's choices (the positions of
    its loops, and whether the forward loop is rolled too)."""
    known = found(graph)
    used: set[int] = set()
    pairs: list[tuple[tuple[int, int, bool], Pair]] = []
    share = policy.REWRITE.share_of_budget * budget
    for k, later in enumerate(known.loops):
        for e, earlier in enumerate(known.loops[:k]):
            if e in used or k in used:
                continue
            pair = known.pair(graph, e, k)
            same = earlier[0].run.count == later[0].run.count
            if same and pair.reads > share:
                pairs.append(((e, k, True), pair))
                used |= {e, k}
            elif pair.recomputes > share:
                pairs.append(((e, k, False), Pair(None, pair.later, 0, pair.recomputes)))
                used.add(k)
    for k, later in enumerate(known.loops):
        if k not in used and (merged := known.merged(graph, k)) > share:
            pairs.append(((k, k, False), Pair(None, later[0], 0, merged)))
            used.add(k)
    return sorted(pairs, key=lambda kp: kp[1].later.run.start)


def chosen(graph: Graph, budget: int) -> list[Pair]:
    """The loops worth rolling, over the remat pass's share of ``budget``: a forward loop and a
    later one of as many blocks that reads that much of its values as whole stacks (both
    rolled: the remat pass then recomputes the residuals); or a later loop that recomputes that
    much of a forward loop's values (rolled alone: XLA would merge each recomputation with the
    forward and keep them all alive). A loop is rolled once at most. The loops and their pairs
    do not depend on the budget: they are found once per program."""
    return [pair for _, pair in _chosen(graph, budget)]


def _record(pair: Pair, graph: Graph) -> PassRecord:
    later = pair.later
    blocks = f"{later.run.count} repeated blocks of {later.run.period} equations"
    if pair.forward is None:
        what = f"{blocks}, recomputing {format_bytes(pair.recomputes)} of earlier blocks' values,"
    else:
        fwd = pair.forward
        what = (
            f"{fwd.run.count} repeated blocks of {fwd.run.period} equations and the {blocks} "
            f"that read {format_bytes(pair.reads)} of their values"
        )
    return PassRecord(
        "roll",
        f"{what} rolled into scans",
        where=source_line(graph.eqns[pair.loops[0].run.start]),
        data={"blocks": later.run.count},
    )


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Roll each forward run and the run that reads its residuals, where worth it. The rewrite
    of a program for a choice of pairs is made once: an attempt at another chunk scale that
    chooses the same pairs reuses it."""
    if not ctx.roll:
        return closed
    graph = Graph(closed)
    keyed = _chosen(graph, ctx.temp_budget)
    if not any(pair.forward for _, pair in keyed):  # blocks cut by the pieces they place?
        moved = _sunk(closed)
        if moved is not closed:
            moved_graph = Graph(moved)
            other = _chosen(moved_graph, ctx.temp_budget)
            if sum(len(p.loops) for _, p in other) > sum(len(p.loops) for _, p in keyed):
                closed, graph, keyed = moved, moved_graph, other
    pairs = [pair for _, pair in keyed]
    rolled = sorted((lp for p in pairs for lp in p.loops), key=lambda lp: lp.run.start)
    if not rolled:
        return closed
    known, key = found(graph), tuple(k for k, _ in keyed)
    if key not in known.rolled:
        try:
            new = retrace(closed, groups=_Rewrite(graph, rolled).groups)
        except Exception as err:  # a loop JAX does not take as a scan (carry types)
            logger.info("roll: left unrolled (%s)", err)
            new = None
        known.rolled[key] = None if new is None else dce(new)
    new = known.rolled[key]
    if new is None:  # keep the blocks
        return closed
    for pair in pairs:
        ctx.record(_record(pair, graph))
    return new
