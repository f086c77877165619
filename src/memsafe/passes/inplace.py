"""In place: a sum of zero-padded pieces whose partial sums would not fit the room for
temporaries is one buffer the pieces are written into (:mod:`memsafe.rules.pads`).

The gradient of a stacked parameter read a slice per layer in a Python loop sums one pad per
layer; XLA may hold a partial sum per layer, each as large as the stack. Where those fit the
room, the pads stay: the split pass reads them as pieces of a concatenation and can split
through them, which the in-place updates (along the stack's axis) would stop.
"""

from __future__ import annotations

from memsafe._jax import ClosedJaxpr
from memsafe.context import PassContext
from memsafe.rewrite.match import apply_matches
from memsafe.rules import pads

#: Its result depends on the program and the unscaled room alone, not on the chunk scale: run
#: once per search (:class:`memsafe.passes.base.Pass`).
SCALE_FREE = True


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """The chains whose partial sums exceed ``ctx.room`` as in-place updates, each recorded."""
    found = pads.find_rewrites(closed, room=ctx.room)
    if not found:
        return closed
    for rewrite in found:
        ctx.record(rewrite.record)
    return apply_matches(closed, [], found)
