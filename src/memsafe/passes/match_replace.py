"""Match-and-replace: expressions that have a cheaper equivalent are rewritten by the active rules
(:mod:`memsafe.rules`) and the built-in procedural rewrites, recorded one by one. The matching is
:mod:`memsafe.rewrite.match`."""

from __future__ import annotations

from memsafe._jax import ClosedJaxpr
from memsafe.context import PassContext
from memsafe.graph import inline_calls
from memsafe.rewrite.match import apply_rules
from memsafe.rules.registry import active_rules, builtin_rewrites

#: Its result does not depend on the attempt (the active rules and the program alone decide
#: what it rewrites): run once per search (:class:`memsafe.passes.base.Pass`).
SCALE_FREE = True


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """The pipeline entry point: rewrite with the active rules, recording each rewrite.

    Replacements may carry custom derivative rules (the squared distance's exact VJP); unless
    ``ctx.keep_custom_derivatives``, only their primal computation is kept, which later passes
    (splitting) can see into."""
    new, records = apply_rules(closed, active_rules(), rewrites=builtin_rewrites())
    for rec in records:
        ctx.record(rec)
    if records and not ctx.keep_custom_derivatives:
        new = inline_calls(new)
    return new
