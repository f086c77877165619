"""Built-in rewrite: a matrix product that is only read in pieces is computed piece by piece.

A transformer's fused projection ``q, k, v = jnp.split(x @ w_qkv, 3, axis=-1)`` (and a gated
MLP's ``a, b = jnp.split(x @ w, 2, axis=-1)``) stores the whole product and then the pieces the
split copies out of it: twice the activations for a moment. Each piece is a product of its own,
``x @ w_qkv[:, i*d:(i+1)*d]``, with the same contraction for each of its elements, so computing
the pieces directly stores only them (and the small slices of the weight).

Its gradient has the mirror form: the pieces' cotangents are concatenated along the same free axis
and contracted with the activations, ``concat([dq, dk, dv], -1)^T @ x``; that is the
concatenation of the three products ``dq^T @ x``, ... (each element is the same contraction), so
the activation-sized concatenation is not stored, only the weight-sized products. A graph
network's node update ``concat([h, agg]) @ w`` contracts its concatenation; its weight gradient
``concat([h, agg])^T @ g`` reads it along a free axis: where the program holds the pieces until
then anyway, that one reads them, so the concatenation is not held from the forward pass to the
backward.

Both fire only where the bytes they avoid exceed those they add; which elements are summed with
which is unchanged (only how XLA blocks each contraction may differ, as for any change of shape).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from jax import lax

from memsafe._jax import ClosedJaxpr, JaxprEqn, Var, bind_eqn, nbytes_of_aval, source_line
from memsafe.graph import Graph
from memsafe.plan import RuleRecord
from memsafe.primitives import contraction_axes
from memsafe.rules.tile import Rewrite

NAME = "product_in_pieces"

#: A range of one axis, [start, stop).
Span = tuple[int, int]


def _read_spans(eqn: JaxprEqn) -> list[dict[int, Span]] | None:
    """What a ``split`` or unit-stride ``slice`` reads of its operand: for each of its results,
    the axes it restricts and their ranges; None for any other reader."""
    shape = eqn.invars[0].aval.shape
    name = eqn.primitive.name
    if name == "split":
        axis, start, spans = int(eqn.params["axis"]), 0, []
        for size in eqn.params["sizes"]:
            spans.append({axis: (start, start + int(size))})
            start += int(size)
        return spans
    if name == "slice":
        strides = eqn.params.get("strides")
        if strides is not None and any(int(s) != 1 for s in strides):
            return None
        starts, limits = eqn.params["start_indices"], eqn.params["limit_indices"]
        ranges = {
            a: (int(lo), int(hi))
            for a, (lo, hi) in enumerate(zip(starts, limits))
            if (int(lo), int(hi)) != (0, shape[a])
        }
        return [ranges] if ranges else None
    return None


def _cut(x: Any, ranges: dict[int, Span]) -> Any:
    for axis, (lo, hi) in sorted(ranges.items()):
        x = lax.slice_in_dim(x, lo, hi, axis=axis)
    return x


def _operand_ranges(axes: list, ranges: dict[int, Span]) -> tuple[dict[int, Span], ...]:
    """The ranges of each operand a piece of the product (``ranges`` by result axis) reads
    (``axes``: :func:`memsafe.primitives.contraction_axes`)."""
    per: tuple[dict[int, Span], dict[int, Span]] = ({}, {})
    for axis, span in ranges.items():
        for side, operand_axis in enumerate(axes[axis]):
            if operand_axis is not None:
                per[side][operand_axis] = span
    return per


def _sliced_bytes(atom: Any, ranges: dict[int, Span]) -> int:
    if not ranges:
        return 0
    shape = list(atom.aval.shape)
    for axis, (lo, hi) in ranges.items():
        shape[axis] = hi - lo
    return int(np.prod(shape)) * np.dtype(atom.aval.dtype).itemsize


def _read_in_pieces(graph: Graph, index: int) -> Rewrite | None:
    """A product whose result only ``split`` / ``slice`` equations read, along axes that are
    not contracted: each of their results is its own product of the operands' slices."""
    eqn = graph.eqns[index]
    out = eqn.outvars[0]
    info = graph.info(out)
    if info.is_output or not info.consumers:
        return None
    axes = contraction_axes(eqn)
    readers: list[tuple[int, list[dict[int, Span]]]] = []
    for reader in sorted(set(info.consumers)):
        spans = _read_spans(graph.eqns[reader])
        if spans is None:
            return None
        readers.append((reader, spans))
    pieces = [ranges for _, spans in readers for ranges in spans]
    read = sum(_sliced_bytes(out, r) for r in pieces)
    added = sum(
        _sliced_bytes(atom, side_ranges)
        for ranges in pieces
        for atom, side_ranges in zip(eqn.invars, _operand_ranges(axes, ranges))
    )
    saved = nbytes_of_aval(out.aval) - added
    if read > nbytes_of_aval(out.aval) or saved <= 0:
        return None  # pieces that overlap compute more, or the operand slices cost more

    def computes(spans: list[dict[int, Span]]) -> Callable[[Callable[[Any], Any]], Any]:
        def compute(read_var: Callable[[Any], Any]) -> Any:
            lhs, rhs = (read_var(a) if isinstance(a, Var) else a.val for a in eqn.invars)
            results = []
            for ranges in spans:
                lr, rr = _operand_ranges(axes, ranges)
                (piece,) = bind_eqn(eqn, [_cut(lhs, lr), _cut(rhs, rr)])
                results.append(piece)
            return results

        return compute

    (first, first_spans), *rest = readers
    detail = (
        f"product {out.aval.dtype}{list(out.aval.shape)} read in {len(pieces)} pieces is no "
        "longer stored"
    )
    record = RuleRecord(NAME, source_line(eqn), int(saved), 0, detail)
    more = tuple((reader, computes(spans)) for reader, spans in rest)
    region = frozenset({index, *(reader for reader, _ in readers)})
    return Rewrite(first, region, computes(first_spans), record, more)


def _concatenation_read_in_pieces(graph: Graph, index: int) -> Rewrite | None:
    """A concatenation products read, each as one of its operands and along an axis it does not
    contract: each such product is the concatenation of the pieces' products. A fused
    projection's weight gradient ``concat([dq, dk, dv])^T @ x`` then stores no concatenation.
    A product that contracts the concatenated axis (a layer's ``concat([h, agg]) @ w``) still
    reads it whole (its pieces' products would be summed in another order than the product
    sums them; :mod:`memsafe.rules.tile` does so only for broadcast pieces), but where it reads
    it before the others (the weight gradient ``concat([h, agg])^T @ g``) and the program holds
    every piece until then anyway (arguments, values read later), the concatenation is no
    longer held from the forward pass to the backward."""
    cat = graph.eqns[index]
    operand = cat.outvars[0]
    info = graph.info(operand)
    if info.is_output or not info.consumers:
        return None
    axis = int(cat.params["dimension"])
    found = {r: _free_use(graph.eqns[r], operand, axis) for r in sorted(set(info.consumers))}
    readers = [r for r, use in found.items() if use is not None]
    uses = [found[r] for r in readers]
    others = [r for r, use in found.items() if use is None]
    if not readers or (others and max(others) > max(readers)):
        return None  # nothing to read from the pieces, or the concatenation lives as long
    if others and not all(_held_until(graph, p, index, max(readers)) for p in cat.invars):
        return None  # a piece held longer for it would take the concatenation's place
    # the pieces' products beside each result
    added = sum(nbytes_of_aval(graph.eqns[r].outvars[0].aval) for r in readers)
    saved = nbytes_of_aval(operand.aval) - added
    if saved <= 0:
        return None

    def computes(reader: int, use: tuple[int, int]) -> Callable[[Callable[[Any], Any]], Any]:
        eqn = graph.eqns[reader]
        side, out_axis = use

        def compute(read: Callable[[Any], Any]) -> Any:
            other = eqn.invars[1 - side]
            whole = read(other) if isinstance(other, Var) else other.val
            parts = []
            for piece in cat.invars:
                value = read(piece) if isinstance(piece, Var) else piece.val
                pair = [value, whole] if side == 0 else [whole, value]
                parts.append(bind_eqn(eqn, pair)[0])
            return lax.concatenate(parts, out_axis)

        return compute

    kept = f"held only until {len(others)} other reader(s)" if others else "no longer stored"
    detail = (
        f"concatenation {operand.aval.dtype}{list(operand.aval.shape)} read in pieces by "
        f"{len(readers)} product(s) is {kept}"
    )
    record = RuleRecord(NAME, source_line(cat), int(saved), 0, detail)
    (first, *rest), (use, *more_uses) = readers, uses
    more = tuple((r, computes(r, u)) for r, u in zip(rest, more_uses))
    region = frozenset({*readers, *([] if others else [index])})
    return Rewrite(first, region, computes(first, use), record, more)


def _held_until(graph: Graph, atom: Any, cat: int, last: int) -> bool:
    """Whether the program holds ``atom`` (a piece of the concatenation ``cat``) until equation
    ``last`` anyway: a literal, an argument or constant, an output, or read at or after it."""
    if not isinstance(atom, Var):
        return True
    info = graph.info(atom)
    later = any(c >= last for c in info.consumers if c != cat)
    return info.producer is None or info.is_output or later


def _free_use(eqn: JaxprEqn, operand: Var, axis: int) -> tuple[int, int] | None:
    """(the side, the result axis) where the product ``eqn`` reads the concatenation
    ``operand`` along ``axis`` as a free axis of one operand; None for anything else (not a
    product, the concatenation on both sides, a contracted or batch axis)."""
    if eqn.primitive.name != "dot_general":
        return None
    sides = [k for k, v in enumerate(eqn.invars) if v is operand]
    if len(sides) != 1:
        return None
    (side,) = sides
    alone = (axis, None) if side == 0 else (None, axis)
    lands = [k for k, pair in enumerate(contraction_axes(eqn)) if pair == alone]
    return (side, lands[0]) if lands else None


def find_rewrites(closed: ClosedJaxpr) -> list[Rewrite]:
    """Products in ``closed`` read only in pieces, and concatenations products read along free
    axes, latest first, not overlapping."""
    graph = Graph(closed)
    found: list[Rewrite] = []
    claimed: set[int] = set()
    for index in reversed(range(len(graph.eqns))):
        name = graph.eqns[index].primitive.name
        if index in claimed:
            continue
        if name == "dot_general":
            rewrite = _read_in_pieces(graph, index)
        elif name == "concatenate":
            rewrite = _concatenation_read_in_pieces(graph, index)
        else:
            continue
        if rewrite is not None and not (rewrite.region & claimed):
            claimed |= rewrite.region
            found.append(rewrite)
    return found


REWRITES = (find_rewrites,)
