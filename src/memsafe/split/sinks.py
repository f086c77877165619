"""Sinks: equations that consume the split axis, and how their results combine across chunks.

A :class:`Sink` names the equation's :class:`Reducer`, a small object owning the core of that
kind of result: the partial result of one chunk, the fold of a later chunk's partial into the
running one (the monoid), the finished value, its sizing (the smallest chunk it can work with, the
bytes it holds beyond its operands) and whether its accumulator can be rescaled by a factor
(online softmax). What a strategy needs beyond that is a small protocol the reducer may implement,
kept with the strategy: reading a window of an extended chunk
(``memsafe.split.strategies.halo.Windowed``), a partial of a piece of a concatenation
(``memsafe.passes.distribute.Pieced``). Across devices
(``memsafe.split.strategies.sharded.devices``), partials combine by a collective where the monoid's
fold has one (a sum's ``psum``), else in device order: a reducer knows nothing of devices.

Partials are folded left to right, so ties keep the earlier (lower) index as
``argmax``/``argmin``/``top_k`` do on the whole axis. No identity elements are needed: the first
chunk's partial is the initial carry.

A reducer whose fold adds floating-point partials (sums, contractions, combining scatters that
add) keeps partials of floats narrower than 32 bits in float32 (:meth:`Reducer.lift`, applied to
every partial by the runners) and rounds once when it finishes: added in bfloat16, each of
thousands of chunks would round the running sum again (a graph network's gradient split into
7,056 chunks of edges was 0.05 from jax.jit's, which adds a bfloat16 contraction's terms in
float32).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn, bind_eqn_with
from memsafe.split import topk
from memsafe.split.indices import chunk_local_indices

#: The running result of a sink: a tuple of arrays.
Partial = tuple[Any, ...]
Axis = int | None


class Reducer:
    """How the results of one kind of sink combine across chunks of the split axis.

    Subclasses override :meth:`fold` (the monoid) and, where the chunk's result is not the
    equation's own result, :meth:`partial` and :meth:`finish`.
    """

    #: Name shown in plans and records.
    name: str = "sink"
    #: Whether the running result may be multiplied by a factor constant along the axis (the
    #: online-softmax rescale): true of sums and contractions, linear in their operand.
    rescalable: bool = False
    #: Whether the fold adds floating-point partials, so that rounding builds up chunk by chunk
    #: (the partials are then kept in :meth:`accumulator`'s dtype).
    adds: bool = False

    def accumulator(self, dtype: Any) -> np.dtype:
        """The dtype the running result of a ``dtype`` result is kept in: float32 for a float
        narrower than 32 bits where the fold adds, else ``dtype`` itself."""
        dtype = np.dtype(dtype)
        if self.adds and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
            return np.dtype(np.float32)
        return dtype

    def lift(self, part: Partial) -> Partial:
        """A chunk's partial in the dtypes its running result is kept in (every runner lifts
        each partial it makes before folding it)."""
        wide = [self.accumulator(p.dtype) for p in part]
        return tuple(p if p.dtype == w else p.astype(w) for p, w in zip(part, wide))

    def running_bytes(self, aval: Any) -> int:
        """Bytes of one running copy of a result of abstract value ``aval``."""
        return math.prod(aval.shape) * self.accumulator(aval.dtype).itemsize

    def min_chunk(self, eqn: JaxprEqn) -> int:
        """Smallest chunk the sink can work with."""
        return 1

    def partial(
        self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int
    ) -> Partial:
        """The sink's result on one chunk of ``size`` starting at ``start`` along ``axis``."""
        return tuple(bind_eqn(eqn, invals))

    def fold(self, eqn: JaxprEqn, acc: Partial, new: Partial) -> Partial:
        """A later chunk's partial ``new`` folded into the running ``acc``."""
        raise NotImplementedError

    def finish(self, acc: Partial) -> list[Any]:
        """The equation's results from the folded partials (in the accumulator's dtypes:
        :func:`finished` rounds them to the results')."""
        return list(acc)

    def extra_bytes_per_unit(self, operand_bytes: int, size: int) -> int:
        """Bytes per unit of the axis the sink stores beyond the chunk values it reads."""
        return 0

    def chunk_bytes(self, eqn: JaxprEqn, axis: int, chunk: int) -> int:
        """Bytes the sink allocates per chunk that do not scale with the axis (candidates)."""
        return 0

    def __repr__(self) -> str:
        return self.name


class Monoid(Reducer):
    """A sink whose chunk result is the equation's own result, folded elementwise by ``op``
    (sums, contractions, max, min, products, logical and bitwise reductions)."""

    def __init__(self, name: str, op: Any, *, rescalable: bool = False) -> None:
        self.name, self.op, self.rescalable = name, op, rescalable
        self.adds = op is lax.add

    def fold(self, eqn: JaxprEqn, acc: Partial, new: Partial) -> Partial:
        return tuple(self.op(a, b) for a, b in zip(acc, new))


class Contraction(Monoid):
    """A contraction's (``dot_general``'s, a convolution's feature axis's) partials: each
    chunk's product computed straight into the accumulator's dtype (XLA accumulates a
    bfloat16 product's terms in float32 too), summed."""

    def partial(
        self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int
    ) -> Partial:
        wide = self.accumulator(eqn.outvars[0].aval.dtype)
        if wide == eqn.outvars[0].aval.dtype:
            return tuple(bind_eqn(eqn, invals))
        return tuple(bind_eqn_with(eqn, invals, preferred_element_type=wide))


class ArgBest(Reducer):
    """``argmax``/``argmin``: the best value and its global index; a strictly better later value
    wins, NaN wins once (like ``jnp.argmax``)."""

    def partial(
        self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int
    ) -> Partial:
        (idx,) = bind_eqn(eqn, invals)
        val = jnp.take_along_axis(invals[0], jnp.expand_dims(idx, axis), axis=axis)
        return jnp.squeeze(val, axis), idx + lax.convert_element_type(start, idx.dtype)

    def beats(self, new: Any, best: Any) -> Any:
        raise NotImplementedError

    def fold(self, eqn: JaxprEqn, acc: Partial, new: Partial) -> Partial:
        (bv, bi), (nv, ni) = acc, new
        take = self.beats(nv, bv)
        if jnp.issubdtype(nv.dtype, jnp.inexact):
            take = take | (jnp.isnan(nv) & ~jnp.isnan(bv))
        return lax.select(take, nv, bv), lax.select(take, ni, bi)

    def finish(self, acc: Partial) -> list[Any]:
        return [acc[1]]


class ArgMax(ArgBest):
    name = "argmax"

    def beats(self, new: Any, best: Any) -> Any:
        return new > best


class ArgMin(ArgBest):
    name = "argmin"

    def beats(self, new: Any, best: Any) -> Any:
        return new < best


def _top_k_from(top_k: Any, eqn: JaxprEqn, invals: list[Any], start: Any, size: int) -> Partial:
    """The k best of a chunk or piece of ``size`` from ``start`` by ``top_k``, indices global."""
    k = min(int(eqn.params["k"]), size)
    vals, idx = top_k(invals[0], k, axis=eqn.params.get("axis", -1))
    return vals, idx + lax.convert_element_type(start, idx.dtype)


class TopK(Reducer):
    """``top_k`` along the split axis: each chunk's k best (through block maxima where the chunk
    is long), merged with the running k best by a top_k of both (earlier chunk first on ties)."""

    name = "top_k"

    def min_chunk(self, eqn: JaxprEqn) -> int:
        return int(eqn.params["k"])  # the first chunk must hold k elements

    def partial(
        self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int
    ) -> Partial:
        return _top_k_from(topk.top_k, eqn, invals, start, size)

    def piece_partial(
        self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int
    ) -> Partial:
        """A piece's own top_k (block maxima are for chunks; the piece may be split later):
        ``memsafe.passes.distribute.Pieced``."""
        return _top_k_from(lax.top_k, eqn, invals, start, size)

    def fold(self, eqn: JaxprEqn, acc: Partial, new: Partial) -> Partial:
        axis = eqn.params.get("axis", -1) % len(eqn.invars[0].aval.shape)
        vals = lax.concatenate([acc[0], new[0]], axis)
        idx = lax.concatenate([acc[1], new[1]], axis)
        top, pos = lax.top_k(vals, int(eqn.params["k"]), axis=axis)
        return top, jnp.take_along_axis(idx, pos, axis=axis)

    def extra_bytes_per_unit(self, operand_bytes: int, size: int) -> int:
        return -(-operand_bytes // size // 4)  # the block maxima's keys: a quarter at most

    def chunk_bytes(self, eqn: JaxprEqn, axis: int, chunk: int) -> int:
        """The candidates a chunk's block-maxima top_k gathers: per row k blocks of the chosen
        block length, values and indices, gathered and selected."""
        k = int(eqn.params["k"])
        g = topk.block_size(chunk, k)
        if g is None:
            return 0
        aval = eqn.invars[0].aval
        elems = math.prod(aval.shape)
        rows = elems // max(aval.shape[axis], 1)
        return 2 * rows * (k * g + g) * (aval.dtype.itemsize + 4)


class Pick(Reducer):
    """A gather indexing the split axis one position at a time: each chunk gathers the positions
    it holds and the additive identity (-0.0, 0, False) elsewhere, so summing (or or-ing) the
    chunks' partials is exact. A position outside the whole axis gets the gather's own
    out-of-bounds result, from chunk 0."""

    name = "pick"

    def partial(
        self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int
    ) -> Partial:
        dn = eqn.params["dimension_numbers"]
        operand, indices = invals
        length = eqn.invars[0].aval.shape[axis]
        comp = list(dn.start_index_map).index(axis)
        global_pos, shifted = chunk_local_indices(eqn, indices, comp, axis, start)
        fill_or_drop = lax.GatherScatterMode.FILL_OR_DROP
        # clipped positions are always held by one chunk: the fill is never kept then
        fill = eqn.params["fill_value"] if eqn.params["mode"] == fill_or_drop else 0
        local = shifted[..., comp]
        held = (local >= 0) & (local < size)
        outside = ((global_pos < 0) | (global_pos >= length)) & (start == 0)
        (out,) = bind_eqn_with(eqn, [operand, shifted], mode=fill_or_drop, fill_value=fill)
        batch_out = [d for d in range(out.ndim) if d not in dn.offset_dims]
        keep = lax.broadcast_in_dim(held | outside, out.shape, tuple(batch_out))
        return (lax.select(keep, out, jnp.full(out.shape, additive_identity(out.dtype))),)

    def fold(self, eqn: JaxprEqn, acc: Partial, new: Partial) -> Partial:
        op = lax.bitwise_or if acc[0].dtype == jnp.bool_ else lax.add
        return tuple(op(a, b) for a, b in zip(acc, new))


class SlicePick(Pick):
    """A static slice (offset, strided) along the split axis: each chunk supplies the
    positions it holds, the additive identity elsewhere (exact, like :class:`Pick`)."""

    name = "slice"

    def partial(self, eqn: JaxprEqn, invals: list, axis: int, start: Any, size: int) -> Partial:
        p = eqn.params
        rank = len(p["start_indices"])
        strides = list(p["strides"] or (1,) * rank)
        wanted = np.arange(p["start_indices"][axis], p["limit_indices"][axis], strides[axis])
        local = jnp.asarray(wanted, jnp.int32) - lax.convert_element_type(start, jnp.int32)
        held = (local >= 0) & (local < size)
        starts, limits = list(p["start_indices"]), list(p["limit_indices"])
        starts[axis], limits[axis], strides[axis] = 0, size, 1  # other axes sliced as the eqn does
        rows = lax.slice(invals[0], starts, limits, strides)
        taken = jnp.take(rows, jnp.clip(local, 0, size - 1), axis=axis)
        keep = lax.broadcast_in_dim(held, taken.shape, (axis,))
        return (lax.select(keep, taken, jnp.full(taken.shape, additive_identity(taken.dtype))),)


class ScatterInto(Reducer):
    """A combining scatter (``segment_sum``, the gradient of a gather) whose updates and indices
    are split along their scatter axis: each chunk scatters its updates into the operand (chunk
    0, the one at the axis's start) or into the combiner's identity (the others), and the chunks'
    results are folded by the combiner. Sums fold in another order than one scatter adds its
    updates, as every split sum does.

    Attributes:
        name: shown in plans.
        op: the combiner (``lax.add``, ``lax.mul``, ``lax.max``, ``lax.min``).
        identity: the combiner's identity for a dtype.
    """

    def __init__(self, name: str, op: Any, identity: Any) -> None:
        self.name, self.op, self.identity = name, op, identity
        self.adds = op is lax.add

    def partial(
        self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int
    ) -> Partial:
        operand, indices, updates = invals
        fill = jnp.full(operand.shape, self.identity(operand.dtype), operand.dtype)
        base = lax.select(jnp.full(operand.shape, start == 0), operand, fill)
        return tuple(bind_eqn(eqn, [base, indices, updates]))

    def fold(self, eqn: JaxprEqn, acc: Partial, new: Partial) -> Partial:
        return tuple(self.op(a, b) for a, b in zip(acc, new))

    def chunk_bytes(self, eqn: JaxprEqn, axis: int, chunk: int) -> int:
        """The identity-filled operand and the chunk's scattered copy of it."""
        aval = eqn.invars[0].aval
        return 2 * math.prod(aval.shape) * aval.dtype.itemsize


def finished(reducer: Reducer, eqn: JaxprEqn, acc: Partial) -> list[Any]:
    """Sink ``eqn``'s results from its folded partials ``acc``: ``reducer``'s finish, each
    rounded once to the result's dtype where the accumulator kept it wider."""
    return [
        r if r.dtype == o.aval.dtype else lax.convert_element_type(r, o.aval.dtype)
        for r, o in zip(reducer.finish(acc), eqn.outvars)
    ]


def extreme_identity(name: str, dtype: Any) -> Any:
    """The identity of ``max`` (the lowest value of ``dtype``) or ``min`` (the highest)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return np.asarray(name == "min")
    if jnp.issubdtype(dtype, jnp.inexact):
        lowest, highest = -np.inf, np.inf
    else:
        info = np.iinfo(dtype)
        lowest, highest = info.min, info.max
    return np.asarray(lowest if name == "max" else highest, dtype)


def additive_identity(dtype: Any) -> Any:
    """The exact additive identity: x + (-0.0) == x for every float x, signed zeros included."""
    return jnp.asarray(-0.0 if jnp.issubdtype(dtype, jnp.inexact) else 0, dtype)


SUM = Monoid("sum", lax.add, rescalable=True)
DOT = Contraction("dot", lax.add, rescalable=True)
MAX, MIN, PROD = Monoid("max", lax.max), Monoid("min", lax.min), Monoid("prod", lax.mul)
AND, OR = Monoid("and", lax.bitwise_and), Monoid("or", lax.bitwise_or)
XOR = Monoid("xor", lax.bitwise_xor)
SLICE = SlicePick()
_max_identity = functools.partial(extreme_identity, "max")
_min_identity = functools.partial(extreme_identity, "min")
#: The reducer of each combining scatter, by primitive name.
SCATTER_INTO: dict[str, Reducer] = {
    name: reducer
    for names, reducer in (
        (("scatter-add", "scatter_add"), ScatterInto("scatter-add", lax.add, additive_identity)),
        (("scatter-mul", "scatter_mul"), ScatterInto("scatter-mul", lax.mul, lambda d: 1)),
        (("scatter-max", "scatter_max"), ScatterInto("scatter-max", lax.max, _max_identity)),
        (("scatter-min", "scatter_min"), ScatterInto("scatter-min", lax.min, _min_identity)),
    )
    for name in names
}
ARGMAX, ARGMIN, TOP_K, PICK = ArgMax(), ArgMin(), TopK(), Pick()

#: The reducer of each reduction monoid named in ``memsafe.primitives``.
BY_MONOID: dict[str, Reducer] = {
    r.name: r for r in (SUM, MAX, MIN, PROD, AND, OR, XOR, ARGMAX, ARGMIN)
}


@dataclass(frozen=True)
class Sink:
    """The equation consumes the split axis; ``reducer`` combines its results across chunks.

    Attributes:
        reducer: how the chunks' results combine.
        ins: the split axis in each operand (None: the operand is used whole).
    """

    reducer: Reducer
    ins: tuple[Axis, ...]

    @property
    def kind(self) -> str:
        return self.reducer.name

    @property
    def axis(self) -> int:
        """The split axis in the first operand that carries it (a convolution's kernel taps
        are split with the input read whole)."""
        return next(a for a in self.ins if a is not None)
