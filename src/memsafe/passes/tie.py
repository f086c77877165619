"""Tie: a buffer made from no data is made where the loop or update that fills it starts.

XLA's CPU backend runs independent operations side by side, so its buffer assignment lets two
values share memory only where the program's data dependencies order them, not where its
schedule happens to. A value computed from literals alone (the zeros a chunk loop accumulates
into, the ``-inf`` a running maximum starts from, the zeros ``segment_sum`` scatters into)
depends on nothing: it may be made at any time, so it shares memory with nothing made before
its loop starts. Measured (jax 0.10.2, CPU): ``K`` rounds of ``h = h + tanh(acc_k @ w)``, each
``acc_k`` a float32[1686, 32] summed by a ``fori_loop`` from ``jnp.zeros``, hold 217 KiB of
temporaries at K = 1 and 1.27 MiB at K = 6, one buffer per round; with each ``zeros`` computed
from a scalar of ``h`` they hold 265 KiB at K = 6.

This pass gives such a value, where a loop carries it or an in-place update (``scatter``,
``dynamic_update_slice``) writes into it, a data dependency on the other operand of that loop
or update made last in the program: its fill becomes ``fill - |z|`` (integers ``fill + z``),
where ``z`` is a zero computed from one element ``d`` of that operand (``select(isfinite(d), d *
0, 0)``, which XLA does not fold). The value is the same bit for bit (``x - 0.0`` is ``x`` for
every float, ``-0.0``, ``inf`` and NaN included), and it is now made after that operand, where
the buffers freed before it can hold it. One operand, not all: reading an element of each let
XLA's scheduler move other work, and a graph network step's temporaries grew 9% (1.33 -> 1.45
MB) where one operand left them as they were. The program's own inputs are not dependencies
worth adding (they exist from the start), nor are values smaller than
``policy.REWRITE.tie_min_bytes``. Loop bodies and branches are tied the same way, against
their own values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from memsafe import policy
from memsafe._jax import (
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    Var,
    bind_eqn,
    carry_positions,
    nbytes_of_aval,
    scan_counts,
)
from memsafe.context import PassContext
from memsafe.graph.bodies import bodies, with_bodies
from memsafe.graph.interpret import evaluate, retrace
from memsafe.plan import PassRecord
from memsafe.primitives import IN_PLACE

#: Its result depends on the program alone: run once per program it is given in a search.
SCALE_FREE = True


def _filled(eqn: JaxprEqn) -> bool:
    """Whether ``eqn`` broadcasts a literal scalar: a value made from no data."""
    if eqn.primitive.name != "broadcast_in_dim":
        return False
    operand = eqn.invars[0]
    return isinstance(operand, Literal) and np.ndim(operand.val) == 0


def _held(eqn: JaxprEqn) -> list[int]:
    """The operand positions of ``eqn`` whose values it holds as a buffer of its own: a loop's
    carries, an in-place update's target."""
    return [0] if eqn.primitive.name in IN_PLACE else list(carry_positions(eqn))


def _tieable(dtype: Any) -> bool:
    return jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)


def _zero(dep: Any) -> Any:
    """A float32 ``+0.0`` computed from one element of ``dep`` (a numeric array), which XLA
    cannot fold to a constant."""
    d = lax.slice(dep, (0,) * dep.ndim, (1,) * dep.ndim).reshape(())
    if jnp.issubdtype(d.dtype, jnp.complexfloating):
        d = jnp.real(d)
    d = d.astype(jnp.float32)
    return jnp.abs(lax.select(jnp.isfinite(d), d * 0, jnp.zeros_like(d)))


def _tied(fill: Any, shape: Sequence[int], dims: Sequence[int], dtype: Any, zero: Any) -> Any:
    """``broadcast(fill)`` made from ``zero`` (:func:`_zero`): the same values, after it."""
    scalar = jnp.asarray(fill, dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        scalar = scalar - zero.astype(dtype)
    else:
        scalar = scalar + zero.astype(dtype)
    return lax.broadcast_in_dim(scalar, tuple(shape), tuple(dims))


def _last(
    eqn: JaxprEqn, invals: list[Any], skip: Sequence[int], made: dict, made_at: dict[Var, int]
) -> Any | None:
    """The value of the operand of ``eqn`` (but those at ``skip``) made last in the program, of
    those worth a dependency: numeric, not empty, not made from no data (``made``), not an input
    (available from the start); None where none is."""
    best, at = None, -1
    for k, (var, val) in enumerate(zip(eqn.invars, invals)):
        if k in skip or not isinstance(var, Var) or var in made or var not in made_at:
            continue
        if not hasattr(val, "dtype") or np.size(val) == 0 or not _numeric(val.dtype):
            continue
        if made_at[var] > at:
            best, at = val, made_at[var]
    return best


def _numeric(dtype: Any) -> bool:
    """Whether ``dtype`` is a number or a bool (not an extended dtype such as a PRNG key's)."""
    try:
        return bool(jnp.issubdtype(dtype, jnp.number) or jnp.issubdtype(dtype, jnp.bool_))
    except TypeError:
        return False


def _sites(jaxpr: Any) -> tuple[dict[Var, JaxprEqn], dict[int, list[int]]]:
    """The values of ``jaxpr`` made from no data (by variable, their broadcasts), and the
    operand positions of each equation (by index) that holds one of them worth tying."""
    made = {v: e for e in jaxpr.eqns if _filled(e) for v in e.outvars}
    floor = policy.REWRITE.tie_min_bytes
    sites = {}
    for i, eqn in enumerate(jaxpr.eqns):
        positions = [
            k
            for k in _held(eqn)
            if isinstance(eqn.invars[k], Var)
            and eqn.invars[k] in made
            and nbytes_of_aval(eqn.invars[k].aval) >= floor
            and _tieable(eqn.invars[k].aval.dtype)
        ]
        if positions:
            sites[i] = positions
    return made, sites


def _stacked(eqn: JaxprEqn) -> list[int]:
    """The positions, among a ``scan``'s stacked outputs, of those worth tying: the buffers
    its lowering makes from no data and writes row by row."""
    if eqn.primitive.name != "scan":
        return []
    _, carries = scan_counts(eqn.params)
    floor = policy.REWRITE.tie_min_bytes
    return [
        k
        for k, v in enumerate(eqn.outvars[carries:])
        if nbytes_of_aval(v.aval) >= floor and _tieable(v.aval.dtype)
    ]


def _any_site(closed: ClosedJaxpr, sites: dict[int, list[int]] | None = None) -> bool:
    """Whether ``closed``, or a body or branch it runs, holds a value worth tying (``sites``:
    its own, where :func:`_sites` found them already)."""
    eqns = closed.jaxpr.eqns
    if sites is None:
        sites = _sites(closed.jaxpr)[1]
    if sites or any(_stacked(e) for e in eqns):
        return True
    return any(_any_site(b) for e in eqns for b in bodies(e))


def _tie(closed: ClosedJaxpr, records: list[str]) -> ClosedJaxpr:
    """``closed`` with its values made from no data tied to the operands of the loops and
    updates that hold them, and so are its loops' bodies and branches (``closed`` itself where
    none is)."""
    jaxpr = closed.jaxpr
    made, sites = _sites(jaxpr)
    if not _any_site(closed, sites):
        return closed
    made_at = {v: i for i, e in enumerate(jaxpr.eqns) for v in e.outvars}

    def override(i: int, eqn: JaxprEqn, invals: list[Any]) -> Sequence[Any] | None:
        new = list(invals)
        positions = sites.get(i, ())
        dep = _last(eqn, invals, positions, made, made_at) if positions else None
        zero = None if dep is None else _zero(dep)
        for k in positions if dep is not None else ():
            src = made[eqn.invars[k]]
            aval = eqn.invars[k].aval
            dims = src.params["broadcast_dimensions"]
            new[k] = _tied(src.invars[0].val, aval.shape, dims, aval.dtype, zero)
            records.append(f"{aval.dtype}{list(aval.shape)} into {eqn.primitive.name}")
        stacked = _stacked(eqn)
        if stacked:
            dep = _last(eqn, new, (), made, made_at)
            if dep is not None:
                _, carries = scan_counts(eqn.params)
                for k in stacked:
                    aval = eqn.outvars[carries + k].aval
                    records.append(f"{aval.dtype}{list(aval.shape)} stacked by scan")
                return _carried(eqn, new, _tie(eqn.params["jaxpr"], records), stacked, dep)
        if bodies(eqn):
            got = with_bodies(eqn, new, lambda b: _tie(b, records))
            if got is not None:
                return got
        if all(a is b for a, b in zip(new, invals)):
            return None
        return bind_eqn(eqn, new)

    return retrace(closed, override)


def _carried(
    eqn: JaxprEqn, invals: list[Any], body: ClosedJaxpr, stacked: list[int], dep: Any
) -> list[Any]:
    """``eqn``, a ``scan``, run again with ``body`` and its stacked outputs at ``stacked``
    carried as buffers made after ``dep`` (:func:`_tied`) and written row by row
    (``dynamic_update_slice``, as XLA lowers stacked outputs, whose buffers it makes from no
    data): the same values."""
    consts_n, carries = scan_counts(eqn.params)
    length, reverse = eqn.params["length"], eqn.params["reverse"]
    consts = invals[:consts_n]
    init, xs = invals[consts_n : consts_n + carries], invals[consts_n + carries :]
    ys = [v.aval for v in eqn.outvars[carries:]]
    zero = _zero(dep)
    bufs = [_tied(0, ys[k].shape, (), ys[k].dtype, zero) for k in stacked]

    def step(state: tuple, x: list[Any]) -> tuple:
        i, carry, held = state
        outs = evaluate(body, [*consts, *carry, *x])
        at = length - 1 - i if reverse else i
        rows = outs[carries:]
        held = [lax.dynamic_update_index_in_dim(b, rows[k], at, 0) for b, k in zip(held, stacked)]
        rest = [y for k, y in enumerate(rows) if k not in stacked]
        return (i + 1, outs[:carries], held), rest

    start = (jnp.int32(0), list(init), bufs)
    unroll = eqn.params.get("unroll", 1)
    (_, carry, held), rest = lax.scan(
        step, start, list(xs), length=length, reverse=reverse, unroll=unroll
    )
    out, rest = list(carry), list(rest)
    for k in range(len(ys)):
        out.append(held[stacked.index(k)] if k in stacked else rest.pop(0))
    return out


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """``closed`` with each large value made from no data made after the other operands of the
    loop or update that holds it; recorded with the values tied."""
    records: list[str] = []
    new = _tie(closed, records)
    if records:
        more = f" and {len(records) - 4} more" if len(records) > 4 else ""
        shown = ", ".join(records[:4]) + more
        ctx.record(PassRecord("tie", f"{len(records)} buffers made after their operands: {shown}"))
    return new
