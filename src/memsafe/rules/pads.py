"""Built-in rewrite: a sum of zero-padded pieces is one buffer the pieces are written into.

The gradient of ``ws[i]`` (a slice of a stacked parameter read in a Python loop of layers) is the
cotangent of the slice padded with zeros to the whole stack, and the gradient of the stack sums
one such pad per read: ``((pad(g1) + pad(g2)) + pad(g3)) + ...``. XLA stores each partial sum
as a new stack-sized buffer (two alive at once), for pieces that touch a slice of it each. Here
each ``add`` whose operand is a zero-filled ``pad`` becomes an update of that slice alone,
``dynamic_update_slice(acc, acc[slice] + g, start)``, which XLA does in place: one stack-sized
buffer, written once, each piece dead once it is written.

Exact, zeros' signs included. ``acc + 0`` equals ``acc`` unless ``acc`` holds ``-0.0``. The first
sum of two pads (``pad(g1) + pad(g2)``, the pieces not overlapping) starts from zeros written
with ``0 + g1``, as the original adds ``g1`` to the other pad's zeros, and every later update adds
to what the buffer holds, as the original does. A float sum is ``-0.0`` only where both operands
are, and the buffer's zeros are ``+0.0``, so it never holds ``-0.0``: adding the other pads' zeros
changed nothing. A chain is rewritten from a sum of two pads whose pieces do not overlap; a sum
with any other value (which may hold ``-0.0``) stops it.

The pass :mod:`memsafe.passes.inplace` applies it where the partial sums would not fit the
room for temporaries, and only where XLA stores the chain's result (read by several
operations, as an Adam update reads the gradient twice; an output; a reader that is not
elementwise): a sum read once by elementwise work (an SGD update) is fused into its reader with
all its pads, and the pieces are all XLA stores; there, one buffer from the first piece on
would hold more, not less.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from jax import lax

from memsafe import primitives
from memsafe._jax import ClosedJaxpr, Literal, Var, nbytes_of_aval, source_line
from memsafe.graph import Graph
from memsafe.plan import RuleRecord
from memsafe.rules.tile import Rewrite

NAME = "pads_into_update"

#: A piece: the padded operand, and the (start, size) of each axis it fills.
Piece = tuple[Var, tuple[tuple[int, int], ...]]


def _piece(graph: Graph, atom: Any) -> Piece | None:
    """The piece ``atom`` pads with zeros (no interior padding, no cropping), where the sum is
    its only reader; else None."""
    if not isinstance(atom, Var):
        return None
    info = graph.info(atom)
    if info.producer is None or info.is_output or len(info.consumers) != 1:
        return None
    pad = graph.eqns[info.producer]
    if pad.primitive.name != "pad" or not isinstance(pad.invars[0], Var):
        return None
    fill = pad.invars[1]  # +0.0 (the argument of exactness counts on the zeros' sign)
    if not isinstance(fill, Literal) or np.asarray(fill.val).item() != 0:
        return None
    if np.signbit(np.asarray(fill.val)):
        return None
    config = pad.params["padding_config"]
    if any(lo < 0 or hi < 0 or mid != 0 for lo, hi, mid in config):
        return None
    source = pad.invars[0]
    return source, tuple((int(lo), int(n)) for (lo, _, _), n in zip(config, source.aval.shape))


def _overlap(a: Piece, b: Piece) -> bool:
    return all(s < t + m and t < s + n for (s, n), (t, m) in zip(a[1], b[1]))


@dataclass(frozen=True)
class Link:
    """A sum of a chain: the pieces written up to it (in order, its own last), the chain before
    it (``acc``; None where it is the first sum, of two pads) and the pad it adds."""

    pieces: tuple[Piece, ...]
    acc: Var | None
    pad: Var


def _link(graph: Graph, index: int, known: dict[int, Link | None]) -> Link | None:
    """The sum at ``index`` as a link of a chain, or None where it is not one: a sum of a pad
    and either a chain read by it alone or a pad whose piece the first does not overlap."""
    if index in known:
        return known[index]
    known[index] = None
    eqn = graph.eqns[index]
    if eqn.primitive.name not in primitives.ADDS or len(eqn.invars) != 2:
        return None
    shape = eqn.outvars[0].aval.shape
    if any(getattr(a.aval, "shape", None) != shape for a in eqn.invars):
        return None
    if np.dtype(eqn.outvars[0].aval.dtype).kind not in "fiu":  # real numbers
        return None
    for acc, pad in (eqn.invars, eqn.invars[::-1]):
        piece = _piece(graph, pad)
        if piece is None:
            continue
        first = _piece(graph, acc)
        if first is not None and not _overlap(first, piece):
            known[index] = Link((first, piece), None, pad)
            return known[index]
        before = _before(graph, acc, known)
        if before is not None:
            known[index] = Link((*before.pieces, piece), acc, pad)
            return known[index]
    return None


def _before(graph: Graph, acc: Any, known: dict[int, Link | None]) -> Link | None:
    """The link ``acc`` is, where this sum is its only reader."""
    if not isinstance(acc, Var):
        return None
    info = graph.info(acc)
    if info.producer is None or info.is_output or len(info.consumers) != 1:
        return None
    return _link(graph, info.producer, known)


def _update(acc: Any, source: Any, place: tuple[tuple[int, int], ...]) -> Any:
    """``acc`` with ``acc[place] + source`` written at ``place``."""
    starts = tuple(s for s, _ in place)
    old = lax.slice(acc, starts, tuple(s + n for s, n in place))
    return lax.dynamic_update_slice(acc, _unsigned_zeros(lax.add(old, source)), starts)


def _unsigned_zeros(x: Any) -> Any:
    """``x`` with ``-0.0`` as ``+0.0``: what the original's sum with the other pads' zeros
    gives. Written as a select, since XLA simplifies ``0 + x`` (or a slice it knows is zeros,
    plus ``x``) to ``x``, sign and all; where the sum was computed it is a no-op."""
    if not np.issubdtype(x.dtype, np.floating):
        return x
    zero = lax.full_like(x, 0)
    return lax.select(lax.eq(x, zero), zero, x)


def _zero(dtype: Any) -> Any:
    return np.zeros((), dtype)


def _config(place: tuple[tuple[int, int], ...], out: Var) -> list[tuple[int, int, int]]:
    """The padding that puts a piece at ``place`` of ``out``."""
    return [(s, d - s - n, 0) for (s, n), d in zip(place, out.aval.shape)]


def _rewrite(graph: Graph, index: int, link: Link) -> Rewrite:
    """The sum at ``index`` as the update of its last piece (the first sum of a chain also
    writes the first piece into zeros)."""
    out = graph.eqns[index].outvars[0]
    pads = [link.pad] if link.acc is not None else list(graph.eqns[index].invars)
    region = frozenset({index, *(graph.info(p).producer for p in pads)})
    detail = f"{out.aval.dtype}{list(out.aval.shape)} written in place, piece {len(link.pieces)}"
    record = RuleRecord(NAME, source_line(graph.eqns[index]), nbytes_of_aval(out.aval), 0, detail)
    source, place = link.pieces[-1]

    def compute(read: Callable[[Any], Any]) -> Any:
        if link.acc is None:  # zeros around the first (a pad, not a fill XLA makes early)
            first, at = link.pieces[0]
            x = read(first)
            acc = lax.pad(_unsigned_zeros(x), _zero(out.aval.dtype), _config(at, out))
        else:
            acc = read(link.acc)
        return _update(acc, read(source), place)

    return Rewrite(index, region, compute, record)


def _stored(graph: Graph, index: int) -> bool:
    """Whether XLA stores the sum at ``index``: a program output, or read by more than one
    operation or by one that is not elementwise. A sum read once by elementwise work is fused
    into its reader with every pad of its chain, and never stored whole: the pieces are."""
    info = graph.info(graph.eqns[index].outvars[0])
    if info.is_output or len(info.consumers) != 1:
        return True
    return graph.eqns[info.consumers[0]].primitive.name not in primitives.ELEMENTWISE


def find_rewrites(closed: ClosedJaxpr, room: int | None = None) -> list[Rewrite]:
    """The chains of sums of zero pads in ``closed`` whose result is stored, as updates; with
    ``room`` (bytes for temporaries), only those whose partial sums XLA may hold (one per sum
    after the first piece's, as large as the result) are more than that room: where they fit,
    the pads are left to the split pass, which reads a pad as pieces of a concatenation
    (:mod:`memsafe.passes.distribute`) and may split through them where the updates stop it."""
    graph = Graph(closed)
    known: dict[int, Link | None] = {}
    links = {i: link for i in range(len(graph.eqns)) if (link := _link(graph, i, known))}
    inner = {graph.info(link.acc).producer for link in links.values() if link.acc is not None}
    chosen: list[int] = []
    for last in sorted(set(links) - inner):
        held = (len(links[last].pieces) - 1) * graph.info(graph.eqns[last].outvars[0]).bytes
        if not _stored(graph, last) or (room is not None and held <= room):
            continue
        index: int | None = last
        while index is not None:
            chosen.append(index)
            acc = links[index].acc
            index = None if acc is None else graph.info(acc).producer
    return [_rewrite(graph, i, links[i]) for i in sorted(chosen)]
