"""Reordering: chains of matrix products re-parenthesized for the smallest peak of live bytes,
then the fewest flops, where every factor is finite (:mod:`memsafe.rewrite.chains`)."""

from __future__ import annotations

from memsafe._jax import ClosedJaxpr
from memsafe.context import PassContext
from memsafe.rewrite.chains import reorder_chains

#: Its result does not depend on the attempt (the program alone decides what it reorders):
#: run once per search (:class:`memsafe.passes.base.Pass`).
SCALE_FREE = True


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """The pipeline entry point: reorder every chain that gains, recording each."""
    new, records = reorder_chains(closed)
    for rec in records:
        ctx.record(rec)
    return new
