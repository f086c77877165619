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

import jax.numpy as jnp
import numpy as np
from jax import lax

from memsafe._jax import (
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    Var,
    bind_eqn_with,
    eval_jaxpr,
    pruned,
    scan_counts,
    scan_layout,
    with_outputs,
)
from memsafe.context import PassContext
from memsafe.graph.interpret import retrace
from memsafe.plan import PassRecord

#: Its program is a function of the program alone (the search runs it once per program it is
#: given: attempts whose earlier passes chose alike share it).
SCALE_FREE = True


def counters(eqn: JaxprEqn) -> dict[int, Any]:
    """Carries of the scan that count its iterations (position among the carries -> step): an
    integer carry whose next value is itself plus a constant (a ``fori_loop``'s index). Its value
    at any iteration follows from the iteration's position."""
    body = eqn.params["jaxpr"].jaxpr
    consts, carry = scan_counts(eqn.params)
    producer = {o: e for e in body.eqns for o in e.outvars}
    found = {}
    for k in range(carry):
        var, out = body.invars[consts + k], body.outvars[k]
        e = producer.get(out) if isinstance(out, Var) else None
        integer = jnp.issubdtype(var.aval.dtype, jnp.integer)
        if e is None or e.primitive.name != "add" or not integer:
            continue
        a, b = e.invars
        step = b if a is var else a if b is var else None
        if isinstance(step, Literal) and np.ndim(step.val) == 0:
            found[k] = step.val
    return found


def _downstream(body: Any, seeds: set[Var]) -> set[Var]:
    """``seeds`` and every body value computed from them."""
    found = set(seeds)
    for e in body.eqns:
        if any(isinstance(v, Var) and v in found for v in e.invars):
            found.update(e.outvars)
    return found


def carry_free_results(eqn: JaxprEqn) -> list[int]:
    """Positions (among the scan's results) of stacked results that depend on no carry but
    the iteration counters (:func:`counters`)."""
    body = eqn.params["jaxpr"].jaxpr
    consts, carry = scan_counts(eqn.params)
    if carry == 0 or body.effects:
        return []
    steps = counters(eqn)
    carried = _downstream(body, {body.invars[consts + k] for k in range(carry) if k not in steps})
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
    steps = {k: v for k, v in counters(eqn).items() if _reads_carry(eqn, moved, k)}
    side = _counted_loop(eqn, invals, moved, steps) if steps else _carry_free(eqn, invals, moved)
    out: list[Any] = [None] * n
    for k, v in zip(kept, main):
        out[k] = v
    for k, v in zip(moved, side):
        out[k] = v
    return out


def _carry_free(eqn: JaxprEqn, invals: list[Any], moved: list[int]) -> list[Any]:
    """The ``moved`` results as a loop with no carry over the inputs they read (the scan's
    constants and initial carries as its constants): an input it leaves unread (a mask the
    carrying loop needs) is no operand of it, so a split does not see it read whole there."""
    consts, carry = scan_counts(eqn.params)
    body, used = pruned(with_outputs(eqn.params["jaxpr"], moved))
    keep = [k for k, u in enumerate(used) if u]
    fixed = sum(1 for k in keep if k < consts + carry)
    layout = scan_layout(eqn.params, fixed, 0, len(keep), len(moved))
    return bind_eqn_with(eqn, [invals[k] for k in keep], jaxpr=body, **layout)


def _reads_carry(eqn: JaxprEqn, moved: list[int], k: int) -> bool:
    """Whether the scan's results at ``moved`` depend on its carry ``k``."""
    body = eqn.params["jaxpr"].jaxpr
    consts, _ = scan_counts(eqn.params)
    tainted = _downstream(body, {body.invars[consts + k]})
    return any(isinstance(body.outvars[m], Var) and body.outvars[m] in tainted for m in moved)


def _counted_loop(
    eqn: JaxprEqn, invals: list[Any], moved: list[int], steps: dict[int, Any]
) -> list[Any]:
    """The ``moved`` results as a carry-free loop whose counters are scanned in: the value a
    counter has at the iteration over position ``i`` is its start plus ``step`` times the
    number of iterations before that one (``length - 1 - i`` of them in a reverse scan)."""
    p = eqn.params
    consts, carry = scan_counts(p)
    length, body = p["length"], p["jaxpr"]
    start = invals[consts : consts + carry]
    before = jnp.arange(length, dtype=jnp.int32)
    if p["reverse"]:
        before = length - 1 - before
    scanned = {
        k: start[k] + (before * jnp.asarray(step, start[k].dtype)).astype(start[k].dtype)
        for k, step in steps.items()
    }

    def one(_: None, at: tuple) -> tuple[None, list[Any]]:
        xs, counted = at
        carries = [counted[k] if k in counted else start[k] for k in range(carry)]
        outs = eval_jaxpr(body.jaxpr, body.consts, *invals[:consts], *carries, *xs)
        return None, [outs[k] for k in moved]

    _, ys = lax.scan(one, None, (list(invals[consts + carry :]), scanned), length=length)
    return ys


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
