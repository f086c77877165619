"""Loops. A ``scan`` runs its iterations in chunks (``lax.map``; with a carry, the loop over
chunks threads it from chunk to chunk); a scan whose body maps the split axis through (rows
through a scan over time or layers) runs whole on each chunk of rows, and where its body sums
over the rows into some results (each layer's parameter gradient in a backward scan over
layers), the chunks' shares of those results are added up (:class:`Summed`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn_with, scan_counts, scan_layout
from memsafe.graph.interpret import inline_calls
from memsafe.split import body as loop_body
from memsafe.split.registry import (
    Mapping,
    NoRule,
    RuleContext,
    Running,
    Side,
    Through,
    split_rule,
)
from memsafe.split.sinks import additive_identity


def _along_length(eqn: JaxprEqn, side: Side, axis: int) -> bool:
    """Whether the axis is the loop's length (the leading axis of a scanned input or output)."""
    consts, carry = scan_counts(eqn.params)
    if side[0] == "in":
        return side[1] >= consts + carry and axis == 0
    return side[1] >= carry and axis == 0


def _length_map(eqn: JaxprEqn) -> Mapping:
    """Along the loop's length, the leading axis of every scanned input and stacked output
    passes and consts are read whole. Without a carry the iterations are independent; with one,
    each chunk of iterations starts from the carry the chunks before it left (:class:`Threaded`):
    the initial carry is read whole and the final carry exists after the last chunk."""
    consts, carry = scan_counts(eqn.params)
    xs = len(eqn.invars) - consts - carry
    ys = len(eqn.outvars) - carry
    return Mapping(ins=(None,) * (consts + carry) + (0,) * xs, outs=(None,) * carry + (0,) * ys)


def _along_length_mapped(eqn: JaxprEqn, m: Mapping) -> bool:
    """Whether ``m`` splits the scan along its length (a scanned input or stacked output at
    axis 0; a split through the body puts the axis one further on these)."""
    consts, carry = scan_counts(eqn.params)
    return 0 in m.ins[consts + carry :] or 0 in m.outs[carry:]


class Threaded(Running):
    """A scan with a carry split along its length: the loop over chunks threads the carry, so
    each chunk's scan runs its iterations from where the chunks before it stopped (a reverse
    scan visits the chunks last first). The results are those of the whole scan, iteration for
    iteration."""

    def applies(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        return scan_counts(eqn.params)[1] > 0 and _along_length_mapped(eqn, mapping)

    def reverse(self, eqn: JaxprEqn) -> bool:
        return bool(eqn.params["reverse"])

    def feed(self, eqn: JaxprEqn, invals: list[Any], carried: Any) -> list[Any]:
        consts, carry = scan_counts(eqn.params)
        return [*invals[:consts], *carried, *invals[consts + carry :]]

    def record(
        self, eqn: JaxprEqn, outs: list[Any], mapping: Mapping, size: int, carried: Any
    ) -> tuple[list[Any], Any]:
        return outs, tuple(outs[: scan_counts(eqn.params)[1]])

    def finals(self, eqn: JaxprEqn, carried: Any) -> dict[int, Any]:
        return dict(enumerate(carried))


@dataclass(frozen=True)
class Summed(Running):
    """A scan split through its body, some of whose results lack the split axis: those exist
    after the loop over chunks.

    - Results the body sums over the split axis into (each layer's parameter gradient, summed
      over the batch) are the sum of each chunk's share (earlier chunks' shares first). A carry
      that is such a sum (an accumulated gradient) starts each chunk after the first from zero:
      the body is linear in it (:mod:`memsafe.split.linear`), so the chunks' shares add up.
    - Results that read nothing of the split axis (a ``fori_loop``'s counter) are the same on
      every chunk, which runs the whole scan: the last chunk's is the result.

    The carried value is (the shares summed so far, the last chunk's same results), each a
    dict keyed by result position, of the results in ``kept`` (None: all; the others are dead).
    ``zeroed``: the positions of every summed result (None: those kept). A summed carry nothing
    reads after the loop still starts each later chunk from zero, as a kept share may be
    computed from it (the cotangent of a scan's carry, added to each iteration's cotangent of
    its input: fuzz seed 2548 counted it once per chunk).
    """

    kept: frozenset[int] | None = None
    zeroed: frozenset[int] | None = None

    def applies(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        return not _along_length_mapped(eqn, mapping) and None in mapping.outs

    def keeping(self, eqn: JaxprEqn, mapping: Mapping, live: frozenset[int]) -> Summed | None:
        return Summed(live, _summed(eqn, mapping)) if live else None

    def feed(self, eqn: JaxprEqn, invals: list[Any], carried: Any) -> list[Any]:
        return _zero_sums(eqn, invals, carried[0] if self.zeroed is None else self.zeroed)

    def record(
        self, eqn: JaxprEqn, outs: list[Any], mapping: Mapping, size: int, carried: Any
    ) -> tuple[list[Any], Any]:
        kept = range(len(outs)) if self.kept is None else self.kept
        sums = _summed(eqn, mapping) & frozenset(kept)
        return loop_body.summed_record(outs, mapping, kept, sums, carried)

    def finals(self, eqn: JaxprEqn, carried: Any) -> dict[int, Any]:
        return loop_body.summed_finals(carried)

    def same_inside(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        """A nested scan whose results without the axis are no sums (its counter)."""
        return not _summed(eqn, mapping)

    def device_start(
        self, eqn: JaxprEqn, invals: list[Any], mapping: Mapping, first: Any
    ) -> list[Any]:
        """A device's first chunk starts its summed carries from the initial carry on the first
        device and from zero on the others (the initial value is then counted once); with
        :meth:`across`, ``memsafe.split.strategies.sharded.mesh.Shardable``: each device's shares
        add up like a chunk's."""
        zeroed = _zero_sums(eqn, invals, _summed(eqn, mapping))
        return [jnp.where(first, v, z) if v is not z else v for v, z in zip(invals, zeroed)]

    def across(self, eqn: JaxprEqn, carried: Any, devices: Any) -> Any:
        """Shares add up over the devices; the same results are every device's own."""
        return {k: lax.psum(v, devices.name) for k, v in carried[0].items()}, carried[1]


def _zero_sums(eqn: JaxprEqn, invals: list[Any], sums: Any) -> list[Any]:
    """The scan's operands with the initial carries of the summed results ``sums`` (result
    positions) at zero."""
    consts, carry = scan_counts(eqn.params)
    fed = list(invals)
    for k in (k for k in sums if k < carry):
        aval = eqn.invars[consts + k].aval  # a sum has no split axis: the whole shape
        fed[consts + k] = jnp.full(aval.shape, additive_identity(aval.dtype))
    return fed


def _summed(eqn: JaxprEqn, m: Mapping) -> frozenset[int]:
    """Positions of the results the body of a scan mapped through it as ``m`` sums over the
    split axis into."""
    body, got = _split_body(eqn, m)
    return frozenset(got.result_shares(body.jaxpr))


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
def inlined_body(body: Any) -> Any:
    """A loop body with its nested calls inlined (asked for at every step of region growth)."""
    return inline_calls(body)


def _body_axes(
    eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext
) -> tuple[Any, loop_body.Reached]:
    """The inlined body and its split, reached in ``ctx`` (a body's context). A stacked result
    is reached from the body inputs: the first input axis that lands on it wins."""
    body = inlined_body(eqn.params["jaxpr"])
    ins, outs = _body_seed(eqn, side, axis)
    consts, carry = scan_counts(eqn.params)
    tied = [(consts + j, j) for j in range(carry)]
    for o, a in outs.items():  # a carried result seeds the carry it comes back through
        if o < carry:
            ins.setdefault(consts + o, a)
    return body, loop_body.reach(body.jaxpr, ins, outs, ctx, tied, sums=True)


def _split_body(eqn: JaxprEqn, m: Mapping) -> tuple[Any, loop_body.Reached]:
    """The inlined body and its split, for a scan mapped through its body as ``m``: reached
    from every operand ``m`` chunks, the fixed point region growth settled on. Reached from one
    of them alone, the walk may meet a carry before the seed that gives it the axis back (the
    backward scan of ``jax.vmap(jax.grad(f))`` through checkpointed steps: "a loop carry takes
    the split axis in but not out", raised while emitting a plan already made)."""
    assert isinstance(m, Through)
    side, axis = next((("in", k), a) for k, a in enumerate(m.ins) if a is not None)
    body = inlined_body(eqn.params["jaxpr"])
    consts, carry = scan_counts(eqn.params)
    ins = {k: a - int(k >= consts + carry) for k, a in enumerate(m.ins) if a is not None}
    tied = [(consts + j, j) for j in range(carry)]
    try:
        return body, loop_body.reach(body.jaxpr, ins, {}, m.ctx, tied, sums=True)
    except NoRule:
        return _body_axes(eqn, side, axis, m.ctx)


def _body_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """The axis through the body: every operand and result at its body axis (one more for the
    scanned and stacked ones); None for the results the body sums over it, and their carries."""
    inner = ctx.in_body()
    body, got = _body_axes(eqn, side, axis, inner)
    axes = got.axes
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
    return Through(ins=ins, outs=outs, ctx=inner)


@split_rule("scan", rebind=lambda *a: _rebind_scan(*a), running=(Threaded(), Summed()))
def _scan(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """Along the loop's length: the iterations run in chunks (threading the carry). Along
    another axis: the body must map it through (the whole loop runs on each chunk). (Where it
    does not, the replay strategy may replay the loop per chunk of an accumulator carry:
    ``memsafe.split.strategies.replay``.)"""
    if _along_length(eqn, side, axis):
        return _length_map(eqn)
    return _body_map(eqn, side, axis, ctx)


def _rebind_scan(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """Along the length: the same loop over the chunk's ``n`` iterations. Along another axis:
    the loop over the chunk, its body re-traced at the chunk's shapes (the chunk's start enters
    as one more constant)."""
    if _along_length_mapped(eqn, m):
        return bind_eqn_with(eqn, invals, length=n)
    body, got = _split_body(eqn, m)
    in_avals = [v.aval for v in body.jaxpr.invars]
    return bind_chunk_body(eqn, invals, loop_body.chunk_body(body, got, n, in_avals), start)


def bind_chunk_body(eqn: JaxprEqn, invals: list[Any], body: Any, start: Any) -> list[Any]:
    """The scan ``eqn`` on ``invals`` with ``body``, a body re-traced for a chunk that reads the
    chunk's start as one more, first, constant."""
    consts, carry = scan_counts(eqn.params)
    layout = scan_layout(eqn.params, consts + 1, carry, len(invals) + 1, len(eqn.outvars))
    return bind_eqn_with(eqn, [jnp.asarray(start, jnp.int32), *invals], jaxpr=body, **layout)
