"""Trips: a while loop whose predicate couples the positions of its state runs twice, first
only to count its iterations, then that many times.

A loop's state split into chunks of an axis (a batch of trajectories) runs whole on each chunk
where the chunks cannot tell how many iterations the others ran (``memsafe.split.prims.whiles``).
A loop that stops when *all* positions are done (``while any(t < t1)``, equinox's ``unvmap_any`` in
diffrax's adaptive solvers) ties them: a chunk stops when its own positions are done, and where the
body lays out what it saves by scalar counters (a checkpointed adjoint's slots), or updates a
position after it is done, a chunk's values then differ from the whole loop's.

Counting first makes any such loop exact: a first loop runs the same predicate and body on only
the carries the predicate reads (the smallest set the body computes them from; the rest, often
the largest, such as a checkpoint buffer, dropped), counting its iterations ``K``; the second runs
the whole body ``K`` times (``i < K``), a predicate that reads nothing of the state, so every chunk
runs exactly the whole loop's iterations, and its values are those of the whole loop on its
positions. The price is the first loop's work (its state only). The two loops are compiled
apart: where the predicate's quantity lies within rounding of its threshold, the count may
differ by one from what jax.jit's own loop runs, as any other compilation of the loop may.

The pass rewrites a loop of the program (not one nested in another's body) whose scalar predicate
reads a carry with axes, whose carries are larger than the temporary budget, and whose counting
carries are at most half of them and of the budget: where the loop fits, or counting saves little,
it is left as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import (
    ClosedJaxpr,
    JaxprEqn,
    carry_positions,
    dce,
    nbytes_of_aval,
    source_line,
    with_outputs,
)
from memsafe.context import PassContext
from memsafe.graph.bodies import inputs_under
from memsafe.graph.interpret import evaluate, retrace
from memsafe.plan import PassRecord, format_bytes


def _counts(eqn: JaxprEqn) -> tuple[int, int]:
    return eqn.params["cond_nconsts"], eqn.params["body_nconsts"]


def _read(jaxpr: Any, outputs: Sequence[int], skip: int) -> set[int]:
    """Positions (after the first ``skip`` inputs) of the inputs of ``jaxpr`` that its outputs
    at ``outputs`` are computed from."""
    found = inputs_under(jaxpr, [jaxpr.outvars[k] for k in outputs])
    return {p - skip for p in found if p >= skip}


def counting_carries(eqn: JaxprEqn) -> list[int]:
    """The carries a while loop's predicate needs: those it reads, and those the body computes
    them from, to a fixed point (in order)."""
    c, b = _counts(eqn)
    cond, body = eqn.params["cond_jaxpr"].jaxpr, eqn.params["body_jaxpr"].jaxpr
    needed = _read(cond, [0], c)
    while True:
        more = needed | _read(body, sorted(needed), b)
        if more == needed:
            return sorted(needed)
        needed = more


def _couples(eqn: JaxprEqn) -> bool:
    """Whether the loop's predicate is a scalar read from carries with axes."""
    c, _ = _counts(eqn)
    cond = eqn.params["cond_jaxpr"].jaxpr
    if cond.outvars[0].aval.shape != ():
        return False
    carries = cond.invars[c:]
    return any(carries[j].aval.shape for j in _read(cond, [0], c))


def _carry_bytes(eqn: JaxprEqn, needed: Sequence[int]) -> tuple[int, int]:
    """(bytes of the carries at ``needed``, bytes of all the loop's carries)."""
    sizes = [nbytes_of_aval(eqn.invars[k].aval) for k in carry_positions(eqn)]
    return sum(sizes[j] for j in needed), sum(sizes)


def worth_counting(eqn: JaxprEqn, budget: int) -> list[int] | None:
    """The counting carries of a while loop the pass rewrites (see the module), else None."""
    if eqn.primitive.name != "while" or not _couples(eqn):
        return None
    needed = counting_carries(eqn)
    counting, total = _carry_bytes(eqn, needed)
    if total <= budget or 2 * counting > total or 2 * counting > budget:
        return None
    return needed


def counted_loop(eqn: JaxprEqn, invals: Sequence[Any], needed: Sequence[int]) -> list[Any]:
    """The while loop ``eqn`` on ``invals`` as two loops: one counting its iterations on the
    carries at ``needed``, then the whole body that many times."""
    c, b = _counts(eqn)
    cond, body = eqn.params["cond_jaxpr"], eqn.params["body_jaxpr"]
    cond_consts, body_consts = list(invals[:c]), list(invals[c : c + b])
    init = list(invals[c + b :])
    slim = with_outputs(body, needed)  # the counting carries' updates alone
    unread = [None] * len(init)

    def full(carries: Sequence[Any]) -> list[Any]:
        out = list(unread)
        for j, x in zip(needed, carries):
            out[j] = x
        return out

    def count_cond(state: tuple) -> Any:
        return evaluate(cond, [*cond_consts, *full(state[1])])[0]

    def count_body(state: tuple) -> tuple:
        return state[0] + 1, tuple(evaluate(slim, [*body_consts, *full(state[1])]))

    start = (jnp.int32(0), tuple(init[j] for j in needed))
    trips, _ = lax.while_loop(count_cond, count_body, start)

    def run_body(state: tuple) -> tuple:
        return state[0] + 1, tuple(evaluate(body, [*body_consts, *state[1]]))

    _, outs = lax.while_loop(lambda s: s[0] < trips, run_body, (jnp.int32(0), tuple(init)))
    return list(outs)


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Count first each while loop of the program worth it (see the module)."""
    budget = ctx.temp_budget
    chosen = {}
    for i, eqn in enumerate(closed.jaxpr.eqns):
        needed = worth_counting(eqn, budget)
        if needed is not None:
            chosen[i] = needed
    if not chosen:
        return closed

    def override(index: int, eqn: JaxprEqn, invals: list[Any]) -> Sequence[Any] | None:
        needed = chosen.get(index)
        return None if needed is None else counted_loop(eqn, invals, needed)

    new = dce(retrace(closed, override=override))
    for i, needed in chosen.items():
        eqn = closed.jaxpr.eqns[i]
        counting, total = _carry_bytes(eqn, needed)
        carries = len(carry_positions(eqn))
        ctx.record(
            PassRecord(
                "trips",
                f"while loop counts its iterations first on {len(needed)} of its "
                f"{carries} carries ({format_bytes(counting)} of {format_bytes(total)}), then "
                "runs that many: its predicate no longer couples the chunks",
                source_line(eqn),
            )
        )
    return new
