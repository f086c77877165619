"""Distribute: operations after a concatenation run on each of its pieces.

``jnp.concatenate([s, -s], axis=0)``, ``jnp.pad(s, ((0, 0), (1, 2)))`` and ``jnp.stack([s,
jnp.sin(s)], -1)`` build a large value from pieces along one axis. A split region follows an axis
of one length, so it stopped there: the pieces are shorter than their concatenation. This pass
moves the operations that follow a concatenation onto its pieces, the way a split loop runs them
on chunks (by the same split rules, with each piece's offset as the chunk's start):

* an operation that maps the axis (elementwise, a reduction over other axes, a matmul's free
  axis, a pad or a slice elsewhere) runs once per piece, and its result is again in pieces
  (operands that carry the axis whole are sliced to each piece);
* a reduction over the axis that folds exactly (a max, an argmax, a top_k, an integer sum, the
  float sum of a stack of two) runs once per piece and folds the pieces' partials, first piece
  first (ties keep the first index); a float sum or contraction over the axis reads the pieces
  concatenated (see :data:`ROUNDING`);
* anything else (a sort or a cumulative sum along the axis, a loop) reads the pieces
  concatenated, as before.

A pad along one axis is the concatenation of its fill, the operand and its fill, and a stack the
concatenation of its operands, each with the new axis of length one. Each piece is
then a value of its own length that the split pass can chunk, and the concatenation is left only
where a result needs it whole (a program output, a sort). Only concatenations larger than an
eighth of the temporary budget are distributed: smaller ones fit as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import jax.numpy as jnp
from jax import lax

from memsafe._jax import ClosedJaxpr, JaxprEqn, Var, dce, inner_jaxpr, nbytes_of_aval
from memsafe.context import PassContext
from memsafe.graph.interpret import inline_calls, retrace
from memsafe.plan import PassRecord
from memsafe.split import registry
from memsafe.split.registry import Mapping, NoRule
from memsafe.split.sinks import Partial, Reducer, Sink, finished


@runtime_checkable
class Pieced(Protocol):
    """A reducer whose result on a piece of a concatenation differs from its result on a chunk
    of a split loop (a ``top_k``'s chunk takes block maxima, meant for loops; a piece may be
    split later): :func:`piece_partial` asks it."""

    def piece_partial(
        self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int
    ) -> Partial:
        """The sink's result on one piece of ``size`` starting at ``start`` along ``axis``."""
        ...


def piece_partial(
    reducer: Reducer, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int
) -> Partial:
    """The sink's result on one piece of a concatenation: a :class:`Pieced` reducer's own,
    else its chunk's ``partial``."""
    if isinstance(reducer, Pieced):
        return reducer.piece_partial(eqn, invals, axis, start, size)
    return reducer.partial(eqn, invals, axis, start, size)


@dataclass(frozen=True)
class Pieces:
    """A value held as pieces along ``axis``: piece ``k`` is positions ``[starts[k], starts[k] +
    sizes[k])`` of it; ``origins`` are the equations (concatenations, pads, stacks) it comes
    from."""

    axis: int
    values: tuple[Any, ...]
    sizes: tuple[int, ...]
    origins: frozenset[int]

    @property
    def starts(self) -> tuple[int, ...]:
        return tuple(sum(self.sizes[:k]) for k in range(len(self.sizes)))

    def same_cut(self, other: Pieces, axis: int) -> bool:
        return other.axis == axis and other.sizes == self.sizes

    def cut(self, value: Any, axis: int) -> list[Any]:
        """``value`` cut along ``axis`` where these pieces are cut."""
        return [
            lax.slice_in_dim(value, s, s + n, axis=axis) for s, n in zip(self.starts, self.sizes)
        ]

    def whole(self) -> Any:
        return lax.concatenate(list(self.values), self.axis)


def _pieces_of(
    operands: list[tuple[Any, Pieces | None]], axis: int
) -> tuple[list[Any], list[int]] | None:
    """Concatenation operands as flat pieces (nested concatenations along the axis unfolded)."""
    values, sizes = [], []
    for val, held in operands:
        if held is not None and held.axis == axis:
            values.extend(held.values)
            sizes.extend(held.sizes)
        elif val.shape[axis]:
            values.append(val)
            sizes.append(val.shape[axis])
    return (values, sizes) if len(values) > 1 else None


def _concatenate(eqn: JaxprEqn, invals: list[Any], held: list) -> tuple[int, list] | None:
    return eqn.params["dimension"], list(zip(invals, held))


def _pad(eqn: JaxprEqn, invals: list[Any], held: list) -> tuple[int, list] | None:
    """A pad along one axis as the operands of a concatenation: fill, operand, fill."""
    axis = _padded_axis(eqn)
    if axis is None:
        return None
    (x, fill), (lo, hi, _) = invals, eqn.params["padding_config"][axis]

    def filled(n: int) -> tuple[Any, None]:
        shape = list(x.shape)
        shape[axis] = n
        return jnp.broadcast_to(jnp.asarray(fill, x.dtype), tuple(shape)), None

    return axis, [filled(lo), (x, held[0]), filled(hi)]


def _stack(eqn: JaxprEqn, invals: list[Any], held: list) -> tuple[int, list] | None:
    if len(invals) < 2:
        return None
    axis = eqn.params["axis"]
    return axis, [(lax.expand_dims(v, (axis,)), None) for v in invals]


#: The primitives whose result joins pieces along an axis, by primitive: (the axis, the pieces as
#: (value, its own pieces or None)), or None where the equation does not join along one axis.
JOINS: dict[str, Callable[[JaxprEqn, list[Any], list], tuple[int, list] | None]] = {
    "concatenate": _concatenate,
    "pad": _pad,
    "stack": _stack,
}


def _within_one_piece(eqn: JaxprEqn, pieces: Pieces) -> Any | None:
    """A slice that reads one piece alone (``x = jnp.indices(...)[0]``), as a slice of that
    piece; None for any other equation."""
    if eqn.primitive.name != "slice":
        return None
    p, axis = eqn.params, pieces.axis
    lo, hi = p["start_indices"][axis], p["limit_indices"][axis]
    for value, start, size in zip(pieces.values, pieces.starts, pieces.sizes):
        if start <= lo and hi <= start + size:
            starts, limits = list(p["start_indices"]), list(p["limit_indices"])
            starts[axis], limits[axis] = lo - start, hi - start
            return lax.slice(value, tuple(starts), tuple(limits), p["strides"])
    return None


def _padded_axis(eqn: JaxprEqn) -> int | None:
    """The one axis a pad widens (no interior padding, no cropping), else None."""
    config = eqn.params["padding_config"]
    padded = [k for k, (lo, hi, mid) in enumerate(config) if (lo, hi, mid) != (0, 0, 0)]
    if len(padded) != 1:
        return None
    lo, hi, mid = config[padded[0]]
    return padded[0] if mid == 0 and lo >= 0 and hi >= 0 else None


#: Reducers whose fold rounds: a float sum over the pieces adds in another order than the one
#: reduction over their concatenation does, and ``jnp.sum(jnp.concatenate([s, -s]), 0)``, exactly
#: zero in one reduction, is not always zero as two (XLA rounds each piece's fusion its own way).
ROUNDING = frozenset({"sum", "dot", "prod"})


def _exact(eqn: JaxprEqn, sink: Sink, pieces: Pieces) -> bool:
    """Whether folding the pieces' partials gives the one reduction's result bit for bit: folds
    that do not round, and a float sum of two pieces of length one (``jnp.stack([a, b]).sum(0)``
    is ``a + b`` in any order)."""
    floats = any(jnp.issubdtype(v.aval.dtype, jnp.inexact) for v in eqn.outvars)
    two_terms = pieces.sizes == (1, 1) and sink.reducer.name == "sum"
    return not floats or sink.reducer.name not in ROUNDING or two_terms


class _Distribute:
    """The override that keeps large concatenations in pieces and runs their users per piece.

    ``bad`` collects the concatenations whose pieces a later operation read whole while large:
    there the pieces gained nothing (the concatenation is built all the same) and may cost a
    split along another axis that went through the concatenation before, so the pass is run
    again without them (``excluded``)."""

    def __init__(self, threshold: int, excluded: frozenset[int] = frozenset()) -> None:
        self.threshold, self.excluded = threshold, excluded
        self.held: dict[Var, Pieces] = {}
        self.bad: set[int] = set()
        self.changes: list[str] = []

    def __call__(self, index: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        held = [self.held.get(a) if isinstance(a, Var) else None for a in eqn.invars]
        if any(h is not None for h in held) and inner_jaxpr(eqn) is None:
            outs = self._per_piece(eqn, invals, held)
            if outs is not None:
                return outs
        outs = None
        if index not in self.excluded and self._large(eqn.outvars[0]):
            outs = self._make_pieces(index, eqn, invals, held)
        if outs is None:
            self._read_whole(eqn.invars, held)
        return outs

    def _large(self, var: Any) -> bool:
        return nbytes_of_aval(var.aval) > self.threshold

    def _read_whole(self, atoms: Any, held: list, axis: int | None = None) -> None:
        """Operands in pieces that are read whole (or cut along another ``axis``)."""
        for atom, h in zip(atoms, held):
            if h is not None and h.axis != axis and self._large(atom):
                self.bad |= h.origins

    def _make_pieces(
        self, index: int, eqn: JaxprEqn, invals: list[Any], held: list
    ) -> list[Any] | None:
        """A concatenation, a pad along one axis or a stack, held as its pieces."""
        join = JOINS.get(eqn.primitive.name)
        joined = None if join is None else join(eqn, invals, held)
        if joined is None:
            return None
        axis, operands = joined
        found = _pieces_of(operands, axis)
        if found is None:
            return None
        self._read_whole(eqn.invars, held, axis)
        origins = frozenset({index}).union(*(h.origins for h in held if h is not None))
        pieces = Pieces(axis, tuple(found[0]), tuple(found[1]), origins)
        self.held[eqn.outvars[0]] = pieces
        return [pieces.whole()]

    def _per_piece(self, eqn: JaxprEqn, invals: list[Any], held: list) -> list[Any] | None:
        """``eqn`` run on each piece of its first operand in pieces (None: it reads them whole)."""
        pos, pieces = next((k, h) for k, h in enumerate(held) if h is not None)
        within = _within_one_piece(eqn, pieces) if pos == 0 else None
        if within is not None:
            self.changes.append("slice reads one piece")
            return [within]
        try:
            m = registry.axis_map(eqn, ("in", pos), pieces.axis, registry.PLAIN)
        except NoRule:
            return None
        if m.ins[pos] != pieces.axis:
            return None  # the operand is read whole (a window, a gather along the axis)
        run = registry.running_along(eqn, m) if not isinstance(m, Sink) else None
        if run is not None and run.sink(eqn, m) is not None:
            m = run.sink(eqn, m)  # a combining scatter: its pieces fold as a sink's
        if isinstance(m, Sink):
            return self._sunk(eqn, invals, held, pieces, m) if _exact(eqn, m, pieces) else None
        total = sum(pieces.sizes)
        if registry.running_along(eqn, m) is not None or any(
            ax is None or var.aval.shape[ax] != total for var, ax in zip(eqn.outvars, m.outs)
        ):
            return None
        return self._mapped(eqn, invals, held, pieces, m)

    def _operands(
        self, eqn: JaxprEqn, invals: list[Any], held: list, ins: tuple, pieces: Pieces
    ) -> list[list[Any]]:
        """Each piece's operands: pieces cut like ``pieces``, other operands carrying the axis
        cut where they are, and operands used whole as they are."""
        cols = []
        for atom, val, h, ax in zip(eqn.invars, invals, held, ins):
            if ax is not None and h is not None and pieces.same_cut(h, ax):
                cols.append(list(h.values))
                continue
            self._read_whole([atom], [h])
            cols.append([val] * len(pieces.sizes) if ax is None else pieces.cut(val, ax))
        return [list(row) for row in zip(*cols)]

    def _mapped(
        self, eqn: JaxprEqn, invals: list[Any], held: list, pieces: Pieces, m: Mapping
    ) -> list[Any]:
        operands = self._operands(eqn, invals, held, m.ins, pieces)
        outs = [
            registry.rebind_piece(eqn, ops, m, jnp.int32(start), size)
            for ops, start, size in zip(operands, pieces.starts, pieces.sizes)
        ]
        origins = frozenset().union(*(h.origins for h in held if h is not None))
        results = []
        for k, (var, ax) in enumerate(zip(eqn.outvars, m.outs)):
            out = Pieces(ax, tuple(o[k] for o in outs), pieces.sizes, origins)
            self.held[var] = out
            results.append(out.whole())
        self.changes.append(f"{eqn.primitive.name} runs on {len(pieces.sizes)} pieces")
        return results

    def _sunk(
        self, eqn: JaxprEqn, invals: list[Any], held: list, pieces: Pieces, sink: Sink
    ) -> list[Any]:
        reducer, acc = sink.reducer, None
        operands = self._operands(eqn, invals, held, sink.ins, pieces)
        for ops, start, size in zip(operands, pieces.starts, pieces.sizes):
            part = reducer.lift(piece_partial(reducer, eqn, ops, sink.axis, jnp.int32(start), size))
            acc = part if acc is None else reducer.fold(eqn, acc, part)
        self.changes.append(
            f"{eqn.primitive.name} reduces {len(pieces.sizes)} pieces ({reducer.name})"
        )
        return finished(reducer, eqn, acc)


def _touches(closed: ClosedJaxpr) -> bool:
    return any(e.primitive.name in JOINS for e in closed.jaxpr.eqns)


def distribute(
    closed: ClosedJaxpr, threshold: int, changes: list[str], keep_custom_derivatives: bool = False
) -> ClosedJaxpr:
    """``closed`` with the users of its concatenations larger than ``threshold`` bytes run per
    piece (itself if none is); what changed is appended to ``changes``. Concatenations whose
    pieces are read whole while large are left as they are. The reducers' folds are inlined (an
    argmax's fold calls ``jnp`` functions that trace as nested jits)."""
    if not _touches(closed):
        return closed
    excluded: frozenset[int] = frozenset()
    while True:
        rewrite = _Distribute(threshold, excluded)
        new = retrace(closed, rewrite)
        if not rewrite.bad - excluded:
            break
        excluded |= rewrite.bad
    if not rewrite.changes:
        return closed
    changes.extend(rewrite.changes)
    return dce(inline_calls(new, keep_custom_derivatives=keep_custom_derivatives))


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Run the users of large concatenations and pads on their pieces."""
    changes: list[str] = []
    new = distribute(closed, ctx.temp_budget // 8, changes, ctx.keep_custom_derivatives)
    for change in dict.fromkeys(changes):
        ctx.record(PassRecord("distribute", change))
    return new


__all__ = ["Pieces", "distribute", "run"]
