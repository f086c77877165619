"""Recomputation: cheap loop-invariant values are recomputed inside the loop body, not held.

A value computed outside a loop and used inside it becomes a constant of the loop: XLA keeps it in a
buffer for the whole loop, even when it is a k-mesh that a fused kernel could regenerate for free
(seed 002's f_filter_with_temp; measured 2.16 MB of temps vs 1.08 MB for the hand-written
f_filter_with_recalc at 64^3). This pass finds constants of ``scan`` loops (fori_loop with static
bounds, lax.scan; see :func:`memsafe.rewrite.invariants.loop_const_positions` for while loops)
computed by *cheap generators* (iota, broadcasts, elementwise ops, reshapes, slices, stacks of
those) from small values, literals or values that are live anyway (program arguments and
constants), and moves their computation into the loop body, where XLA fuses it into its consumers.
Loop bodies are processed recursively. The rewrite itself is :mod:`memsafe.rewrite.invariants`,
which the constants pass and the split planner run too.

Not done here: seed 002's f_stored (a cheap value kept alive across a reduction). Under memsafe's
compile options on the CPU, XLA already writes it into the output buffer and reports no extra temp
(f_stored and f_recalc both 0.5 MB of temps at 131072 x 2), so there is nothing to measure a fix on.
"""

from __future__ import annotations

from memsafe import policy
from memsafe._jax import ClosedJaxpr
from memsafe.context import PassContext
from memsafe.plan import PassRecord
from memsafe.rewrite.invariants import Moving, transform

#: Its program is a function of the program and the room for temporaries alone, the same in
#: every attempt of a search (the search runs it once per program it is given: attempts whose
#: earlier passes chose alike share it).
SCALE_FREE = True


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Recompute the cheap loop-invariant values of ``closed`` (the defaults of
    :class:`memsafe.rewrite.invariants.Moving`, from
    :meth:`memsafe.policy.RewritePolicy.invariant_floor` of the room) inside the bodies of the
    loops that read them, at every depth; records each move."""
    records: list[PassRecord] = []
    new = transform(closed, records, moving=Moving(policy.REWRITE.invariant_floor(ctx.room)))
    for rec in records:
        ctx.record(rec)
    return new
