"""Loop fission: a scan's stacked results that do not depend on its carry run as a loop of
their own, with no carry.

A ``lax.scan`` over layers (flax's ``nn.scan``) stacks, beside the activations that follow the
carry, values computed from each layer's parameters alone (a layer norm's gain broadcast for the
backward pass). Those are the same for every row of a batch, so the split engine cannot run the
loop per chunk of rows while the loop also returns them. Moved into a carry-free scan over the
same inputs (a ``lax.map``), they are computed once, and the loop that carries state returns only
values that follow its carry.
"""

from __future__ import annotations

from typing import Any

from memsafe._jax import (
    ClosedJaxpr,
    JaxprEqn,
    Var,
    bind_eqn_with,
    scan_counts,
    scan_layout,
    with_outputs,
)
from memsafe.graph.interpret import retrace
from memsafe.passes.base import PassContext
from memsafe.plan import PassRecord


def carry_free_results(eqn: JaxprEqn) -> list[int]:
    """Positions (among the scan's results) of stacked results that depend on no carry."""
    body = eqn.params["jaxpr"].jaxpr
    consts, carry = scan_counts(eqn.params)
    if carry == 0 or body.effects:
        return []
    carried = set(body.invars[consts : consts + carry])
    for e in body.eqns:
        if any(isinstance(v, Var) and v in carried for v in e.invars):
            carried.update(e.outvars)
    outs = body.outvars
    return [
        k for k in range(carry, len(outs)) if not (isinstance(outs[k], Var) and outs[k] in carried)
    ]


def _split_scan(eqn: JaxprEqn, invals: list[Any], moved: list[int]) -> list[Any]:
    """The scan as two: the carrying loop without ``moved`` results, and a carry-free loop
    computing them (its constants are the scan's constants and initial carries, unused)."""
    p = eqn.params
    n = len(p["jaxpr"].jaxpr.outvars)
    kept = [k for k in range(n) if k not in moved]
    consts, carry = scan_counts(p)
    main_layout = scan_layout(p, consts, carry, len(invals), len(kept))
    main = bind_eqn_with(eqn, invals, jaxpr=with_outputs(p["jaxpr"], kept), **main_layout)
    side_layout = scan_layout(p, consts + carry, 0, len(invals), len(moved))
    side = bind_eqn_with(eqn, invals, jaxpr=with_outputs(p["jaxpr"], moved), **side_layout)
    out: list[Any] = [None] * n
    for k, v in zip(kept, main):
        out[k] = v
    for k, v in zip(moved, side):
        out[k] = v
    return out


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Move every scan's carry-free stacked results into a loop of their own (top level)."""
    targets = {
        i: moved
        for i, e in enumerate(closed.jaxpr.eqns)
        if e.primitive.name == "scan" and (moved := carry_free_results(e))
    }
    if not targets:
        return closed

    def override(i: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        return _split_scan(eqn, invals, targets[i]) if i in targets else None

    for moved in targets.values():
        ctx.record(
            PassRecord(
                "fission",
                f"scan: {len(moved)} stacked result(s) that depend on no carry run as a "
                "carry-free loop of their own",
            )
        )
    return retrace(closed, override)
