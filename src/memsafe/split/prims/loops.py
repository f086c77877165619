"""Loops. A ``scan`` without a carry (``lax.map``) runs its iterations in chunks; a scan whose
body maps the split axis through (rows through a scan over time or layers) runs whole on each
chunk of rows."""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp

from memsafe._jax import JaxprEqn, bind_eqn_with, scan_counts, scan_layout
from memsafe.graph.interpret import inline_calls
from memsafe.split import body as loop_body
from memsafe.split.registry import Mapping, NoRule, Side, split_rule


def _along_length(eqn: JaxprEqn, side: Side, axis: int) -> bool:
    """Whether the axis is the loop's length (the leading axis of a scanned input or output)."""
    consts, carry = scan_counts(eqn.params)
    if side[0] == "in":
        return side[1] >= consts + carry and axis == 0
    return side[1] >= carry and axis == 0


def _length_map(eqn: JaxprEqn) -> Mapping:
    """Iterations of a scan with no carry are independent: the leading axis of every scanned
    input and stacked output is the loop's length and passes; consts are read whole."""
    consts, carry = scan_counts(eqn.params)
    if carry:
        raise NoRule("scan with a carry along the split axis: its iterations depend on each other")
    xs = len(eqn.invars) - consts
    return Mapping(ins=(None,) * consts + (0,) * xs, outs=(0,) * len(eqn.outvars))


def _body_seed(eqn: JaxprEqn, side: Side, axis: int) -> tuple[dict[int, int], dict[int, int]]:
    """(body input seeds, body output seeds) for the axis at ``side``: scanned inputs and stacked
    outputs lose their leading (length) axis inside the body."""
    consts, carry = scan_counts(eqn.params)
    if side[0] == "in":
        k = side[1]
        return {k: axis - 1 if k >= consts + carry else axis}, {}
    k = side[1]
    return {}, {k: axis - 1 if k >= carry else axis}


@functools.lru_cache(maxsize=64)
def _inlined(body: Any) -> Any:
    """A loop body with its nested calls inlined (asked for at every step of region growth)."""
    return inline_calls(body)


def _body_axes(eqn: JaxprEqn, side: Side, axis: int) -> tuple[Any, dict, dict]:
    """The inlined body, the axis of its values and its equations' mappings. A stacked result
    is reached from the body inputs: the first input axis that lands on it wins."""
    body = _inlined(eqn.params["jaxpr"])
    ins, outs = _body_seed(eqn, side, axis)
    consts, carry = scan_counts(eqn.params)
    tied = [(consts + j, j) for j in range(carry)]
    for o, a in outs.items():  # a carried result seeds the carry it comes back through
        if o < carry:
            ins.setdefault(consts + o, a)
    axes, maps = loop_body.reach(body.jaxpr, ins, outs, tied)
    return body, axes, maps


def _body_map(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    """The axis through the body: every operand and result at its body axis (one more for the
    scanned and stacked ones)."""
    body, axes, _ = _body_axes(eqn, side, axis)
    consts, carry = scan_counts(eqn.params)
    scanned_in = consts + carry
    jaxpr = body.jaxpr

    def outer(k: int, v: Any, scanned: bool) -> int | None:
        a = axes.get(v)
        return None if a is None else a + int(scanned)

    ins = tuple(outer(k, v, k >= scanned_in) for k, v in enumerate(jaxpr.invars))
    outs = tuple(outer(k, v, k >= carry) for k, v in enumerate(jaxpr.outvars))
    given = ins[side[1]] if side[0] == "in" else outs[side[1]]
    if given != axis:
        raise NoRule("scan: the split axis does not pass through the body")
    return Mapping(ins=ins, outs=outs)


@split_rule("scan", rebind=lambda *a: _rebind_scan(*a))
def _scan(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    """Along the loop's length: a carry-free scan's iterations run in chunks. Along another
    axis: the body must map it through (the whole loop runs on each chunk)."""
    if _along_length(eqn, side, axis):
        return _length_map(eqn)
    return _body_map(eqn, side, axis)


def _rebind_scan(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """Along the length: the same loop over the chunk's ``n`` iterations. Along another axis:
    the loop over the chunk, its body re-traced at the chunk's shapes (the chunk's start enters
    as one more constant)."""
    consts, carry = scan_counts(eqn.params)
    xs = range(consts + carry, len(eqn.invars))
    if any(m.ins[k] == 0 for k in xs) or (not carry and 0 in m.outs):
        return bind_eqn_with(eqn, invals, length=n)
    side, axis = next((("in", k), a) for k, a in enumerate(m.ins) if a is not None)
    body, axes, maps = _body_axes(eqn, side, axis)
    in_avals = [v.aval for v in body.jaxpr.invars]
    new = loop_body.chunk_body(body, axes, maps, n, in_avals)
    layout = scan_layout(eqn.params, consts + 1, carry, len(invals) + 1, len(eqn.outvars))
    return bind_eqn_with(eqn, [jnp.asarray(start, jnp.int32), *invals], jaxpr=new, **layout)
