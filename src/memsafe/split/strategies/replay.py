"""Replaying a loop per chunk of an accumulator it only adds to.

The backward loop of a loop that reads a large invariant (a Sinkhorn loop's cost matrix) sums
the invariant's cotangent over the iterations: a carry as large as the matrix that the body reads
only to add the iteration's term to it (``acc + delta``). No axis of that carry passes through
the body when the other carries (the cotangents of the small potentials) are sums over the whole
term, so the body split (:mod:`memsafe.split.body`) refuses it, and held whole it stops every
split of the program.

Such a loop can still run per chunk of the accumulator: each chunk runs the whole loop again, every
other carry computed as before, and adds to its chunk only the chunk's part of each term. The
results are exactly the loop's: the chunk's sums are the same additions in the same order. The work
is the loop's once per chunk, so a replay is only tried where no other split of a value exists
(the planner's retry :data:`REPLAYING`, in ``RuleContext.trying``). The term is still made whole
in each iteration; a split of the body (the pass's next level) chunks it there.

The planner knows replays only as an entry of its retries (:data:`REPLAYING`, in
``memsafe.split.planner.RETRIES``): the loops that may replay are those whose primitive's facts
say so (``memsafe.primitives.REPLAYS``), this module extends the scan's rule
(``memsafe.split.prims.loops``; ``memsafe.split.registry.Extension``) to map one as a
:class:`Replay` where the rule finds no axis through its body and the context tries replays, and
an accumulator's additions are those the facts name (``memsafe.primitives.ADDS``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import jax
from jax import lax

from memsafe._jax import (
    ClosedJaxpr,
    Jaxpr,
    JaxprEqn,
    Var,
    bind_eqn,
    scan_counts,
)
from memsafe.graph import Graph
from memsafe.graph.interpret import evaluate
from memsafe.primitives import ADDS, REPLAYS
from memsafe.split import body as body_split
from memsafe.split.prims.loops import bind_chunk_body, inlined_body
from memsafe.split.registry import Extension, LastChunk, Mapping, RuleContext, Side, extend


class Replaying:
    """The planner's retry with replays (``memsafe.split.planner.Retry``): where no axis of a
    value splits, the value's axes are tried again with loops that only accumulate into a carry
    replayed per chunk of it."""

    def applies(self, graph: Graph) -> bool:
        """Whether ``graph`` holds a loop that may replay."""
        return any(e.primitive.name in REPLAYS for e in graph.eqns)

    def context(self, ctx: RuleContext) -> RuleContext:
        """``ctx`` with replays tried."""
        return replace(ctx, trying=ctx.trying | {self})

    def __repr__(self) -> str:
        return "REPLAYING"


#: The retry with replays: the planner's entry (``memsafe.split.planner.RETRIES``).
REPLAYING = Replaying()


class Replay(Mapping):
    """A loop's mapping where it replays per chunk of the accumulator carry its ``ins`` and
    ``outs`` split; everything else is read whole and every other result is the same on every
    chunk."""


def accumulator_adds(body: Jaxpr, position: int, result: int) -> tuple[int, ...] | None:
    """The indices of the body equations that add the iteration's terms to the carry entering
    at input ``position`` and leaving at result ``result`` (a chain: ``acc + t1 + t2``), or None
    where the carry is not such an accumulator: each sum in the chain must be read by the next
    addition alone, the last be that result and nothing else, and each term have the carry's
    shape."""
    value, adds = body.invars[position], []
    while True:
        if sum(v is value for v in body.outvars) > (1 if adds else 0):
            return None
        uses = [i for i, e in enumerate(body.eqns) if any(a is value for a in e.invars)]
        if not uses:
            break
        if len(uses) != 1 or not _adds_to(body.eqns[uses[0]], value):
            return None
        adds.append(uses[0])
        value = body.eqns[uses[0]].outvars[0]
    return tuple(adds) if adds and body.outvars[result] is value else None


def _adds_to(eqn: JaxprEqn, value: Var) -> bool:
    """Whether ``eqn`` adds a term of ``value``'s shape to ``value`` (read once)."""
    if eqn.primitive.name not in ADDS or sum(a is value for a in eqn.invars) != 1:
        return False
    term = eqn.invars[1] if eqn.invars[0] is value else eqn.invars[0]
    return isinstance(term, Var) and term.aval.shape == value.aval.shape


def chunk_body(body: ClosedJaxpr, position: int, result: int, axis: int, size: int) -> ClosedJaxpr:
    """The body with the accumulator (input ``position``, result ``result``) a chunk of ``size``
    along ``axis``, the chunk's start as an extra first input: every other value as before, the
    term sliced to the chunk before it is added."""
    jaxpr = body.jaxpr
    adds = accumulator_adds(jaxpr, position, result)
    assert adds is not None, "replayed a loop whose carry is no accumulator"
    sums = {jaxpr.invars[position], *(jaxpr.eqns[i].outvars[0] for i in adds)}

    def run(start: jax.Array, *args: jax.Array) -> list[jax.Array]:
        def sliced(i: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
            if i not in adds:
                return None
            chunk = lambda v: lax.dynamic_slice_in_dim(v, start, size, axis)
            return bind_eqn(eqn, [v if a in sums else chunk(v) for a, v in zip(eqn.invars, invals)])

        return evaluate(body, args, sliced)

    avals = [v.aval for v in jaxpr.invars]
    shape = list(avals[position].shape)
    shape[axis] = size
    chunked = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals]
    chunked[position] = jax.ShapeDtypeStruct(tuple(shape), avals[position].dtype)
    start = jax.ShapeDtypeStruct((), jax.numpy.int32)
    new = jax.make_jaxpr(run)(start, *chunked)
    body_split.mark_makes_whole(new)  # the term is whole: the split pass splits inside
    return new


# -- the scan's rule, extended --------------------------------------------------------------------


@dataclass(frozen=True)
class Replayed(LastChunk):
    """A scan replayed per chunk of an accumulator: its other results are the same on every
    chunk; the last chunk's are the results after the loop."""

    def applies(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        return isinstance(mapping, Replay)


def _accumulator(eqn: JaxprEqn, side: Side) -> int | None:
    """The carry at ``side`` where the body only adds each iteration's term to it, else None."""
    consts, carry = scan_counts(eqn.params)
    k = side[1] - consts if side[0] == "in" else side[1]
    if not 0 <= k < carry:
        return None
    body = inlined_body(eqn.params["jaxpr"]).jaxpr
    return k if accumulator_adds(body, consts + k, k) is not None else None


def _replay_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Replay | None:
    """The scan replayed per chunk of the accumulator carry at ``side`` (while replays are
    tried and the carry is one), else None."""
    k = _accumulator(eqn, side) if REPLAYING in ctx.trying else None
    if k is None:
        return None
    consts, _ = scan_counts(eqn.params)
    ins = tuple(axis if j == consts + k else None for j in range(len(eqn.invars)))
    outs = tuple(axis if j == k else None for j in range(len(eqn.outvars)))
    return Replay(ins=ins, outs=outs)


def _rebind_replay(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """The loop over the chunk of its accumulator, its body re-traced at the chunk's shapes (the
    chunk's start enters as one more constant)."""
    consts, _ = scan_counts(eqn.params)
    k = next(j for j, a in enumerate(m.outs) if a is not None)
    new = chunk_body(inlined_body(eqn.params["jaxpr"]), consts + k, k, m.outs[k], n)
    return bind_chunk_body(eqn, invals, new, start)


extend("scan", extension=Extension(_replay_map, Replay, _rebind_replay, (Replayed(),), True))
