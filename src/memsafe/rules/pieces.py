"""Built-in rewrite: a matrix product that is only read in pieces is computed piece by piece.

A transformer's fused projection ``q, k, v = jnp.split(x @ w_qkv, 3, axis=-1)`` (and a gated
MLP's ``a, b = jnp.split(x @ w, 2, axis=-1)``) stores the whole product and then the pieces the
split copies out of it: twice the activations for a moment. Each piece is a product of its own,
``x @ w_qkv[:, i*d:(i+1)*d]``, with the same contraction for each of its elements, so computing
the pieces directly stores only them (and the small slices of the weight).

Its gradient has the mirror form: the pieces' cotangents are concatenated along the same free axis
and contracted with the activations, ``concat([dq, dk, dv], -1)^T @ x``; that is the
concatenation of the three products ``dq^T @ x``, ... (each element is the same contraction), so
the activation-sized concatenation is not stored, only the weight-sized products.

Both fire only where the bytes they avoid exceed those they add; which elements are summed with
which is unchanged (only how XLA blocks each contraction may differ, as for any change of shape).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from jax import lax

from memsafe._jax import ClosedJaxpr, JaxprEqn, Var, bind_eqn, nbytes_of_aval, source_line
from memsafe.graph import Graph
from memsafe.plan import RuleRecord
from memsafe.rules.tile import Rewrite

NAME = "product_in_pieces"

#: A range of one axis, [start, stop).
Span = tuple[int, int]


def _owners(eqn: JaxprEqn) -> list[list[tuple[int, int]]]:
    """For each axis of a product's result, the (operand, axis) pairs it comes from: both
    operands for a batch axis, one for a free axis (the result's order: batch, lhs free, rhs
    free)."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    owners = [[(0, int(a)), (1, int(b))] for a, b in zip(lb, rb)]
    for side, (contract, batch) in enumerate(((lc, lb), (rc, rb))):
        ndim = eqn.invars[side].aval.ndim
        taken = {int(a) for a in (*contract, *batch)}
        owners += [[(side, a)] for a in range(ndim) if a not in taken]
    return owners


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


def _operand_ranges(owners: list, ranges: dict[int, Span]) -> tuple[dict[int, Span], ...]:
    """The ranges of each operand a piece of the product (``ranges`` by result axis) reads."""
    per: tuple[dict[int, Span], dict[int, Span]] = ({}, {})
    for axis, span in ranges.items():
        for side, operand_axis in owners[axis]:
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
    owners = _owners(eqn)
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
        for atom, side_ranges in zip(eqn.invars, _operand_ranges(owners, ranges))
    )
    saved = nbytes_of_aval(out.aval) - added
    if read > nbytes_of_aval(out.aval) or saved <= 0:
        return None  # pieces that overlap compute more, or the operand slices cost more

    def computes(spans: list[dict[int, Span]]) -> Callable[[Callable[[Any], Any]], Any]:
        def compute(read_var: Callable[[Any], Any]) -> Any:
            lhs, rhs = (read_var(a) if isinstance(a, Var) else a.val for a in eqn.invars)
            results = []
            for ranges in spans:
                lr, rr = _operand_ranges(owners, ranges)
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


def _concatenated_operand(graph: Graph, index: int) -> Rewrite | None:
    """A product one of whose operands is a concatenation (read by it alone) along an axis that
    is not contracted: the concatenation of the products of the pieces."""
    eqn = graph.eqns[index]
    found = next(_concatenations(graph, eqn), None)
    if found is None:
        return None
    side, cat, out_axis = found
    operand, out = eqn.invars[side], eqn.outvars[0]
    saved = nbytes_of_aval(operand.aval) - nbytes_of_aval(out.aval)
    if saved <= 0:
        return None

    def compute(read: Callable[[Any], Any]) -> Any:
        other = eqn.invars[1 - side]
        whole = read(other) if isinstance(other, Var) else other.val
        parts = []
        for piece in cat.invars:
            value = read(piece) if isinstance(piece, Var) else piece.val
            pair = [value, whole] if side == 0 else [whole, value]
            parts.append(bind_eqn(eqn, pair)[0])
        return lax.concatenate(parts, out_axis)

    detail = (
        f"concatenation {operand.aval.dtype}{list(operand.aval.shape)} of the product's "
        "operand is no longer stored"
    )
    record = RuleRecord(NAME, source_line(eqn), int(saved), 0, detail)
    return Rewrite(index, frozenset({index, graph.info(operand).producer}), compute, record)


def _concatenations(graph: Graph, eqn: JaxprEqn) -> Iterator[tuple[int, JaxprEqn, int]]:
    """(operand side, its concatenation, the result axis it lands on) for each operand of the
    product ``eqn`` that is a concatenation read by it alone, along a free axis."""
    owners = _owners(eqn)
    for side, operand in enumerate(eqn.invars):
        if not isinstance(operand, Var):
            continue
        info = graph.info(operand)
        if info.producer is None or info.is_output or len(info.consumers) != 1:
            continue
        cat = graph.eqns[info.producer]
        if cat.primitive.name != "concatenate":
            continue
        axis = int(cat.params["dimension"])
        lands = [k for k, pairs in enumerate(owners) if pairs == [(side, axis)]]
        if lands:  # not contracted, not a batch axis
            yield side, cat, lands[0]


def find_rewrites(closed: ClosedJaxpr) -> list[Rewrite]:
    """Products in ``closed`` read only in pieces, or of an operand concatenated along a free
    axis, latest first, not overlapping."""
    graph = Graph(closed)
    found: list[Rewrite] = []
    claimed: set[int] = set()
    for index in reversed(range(len(graph.eqns))):
        eqn = graph.eqns[index]
        if index in claimed or eqn.primitive.name != "dot_general":
            continue
        rewrite = _read_in_pieces(graph, index) or _concatenated_operand(graph, index)
        if rewrite is not None and not (rewrite.region & claimed):
            claimed |= rewrite.region
            found.append(rewrite)
    return found


REWRITES = (find_rewrites,)
