"""How a chunked axis maps through each primitive, and how to re-bind it at chunk shape.

A rule is keyed by primitive name. Given one operand or result of an equation that carries the
split axis at position ``axis``, it answers with a :class:`Mapping` (where the axis sits in every
operand and result; ``None`` for one that does not carry it and is used whole), a :class:`Sink`
(the equation consumes the axis: its results are combined across chunks, see ``sinks.py``), or
raises :class:`NoRule` naming why the axis cannot pass.

Re-binding (:func:`rebind`) evaluates the equation on chunk-shaped operands: most primitives have
no shape in their params; those that do (broadcast_in_dim, reshape, iota, slice, dynamic_slice,
...) get the chunk size written in, and iota along the axis is offset by the chunk's start.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, Literal, bind_eqn, bind_eqn_with
from memsafe.primitives import ELEMENTWISE
from memsafe.split import random_bits, topk

Axis = int | None


@dataclass(frozen=True)
class Mapping:
    """The split axis in each operand and result of an equation (None: does not carry it)."""

    ins: tuple[Axis, ...]
    outs: tuple[Axis, ...]


@dataclass(frozen=True)
class Sink:
    """The equation consumes the axis; ``kind`` says how its results combine across chunks."""

    kind: str
    ins: tuple[Axis, ...]


class NoRule(Exception):
    """The split axis cannot pass through this equation (the message says why)."""


#: Side of the equation the known axis is on: ("in", operand index) or ("out", result index).
Side = tuple[str, int]
Rule = Callable[[JaxprEqn, Side, int], Mapping | Sink]

RULES: dict[str, Rule] = {}
#: Primitives whose params hold shapes and need rewriting at chunk shape.
REBINDERS: dict[str, Callable[[JaxprEqn, list[Any], Mapping, Any, int], list[Any]]] = {}


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


def register(*names: str) -> Callable[[Rule], Rule]:
    def deco(rule: Rule) -> Rule:
        for n in names:
            RULES[n] = rule
        return rule

    return deco


def axis_map(eqn: JaxprEqn, side: Side, axis: int) -> Mapping | Sink:
    """Where the split axis goes through ``eqn``, given it sits at ``axis`` of ``side``."""
    rule = RULES.get(eqn.primitive.name)
    if rule is None:
        raise NoRule(f"no splitting rule for primitive '{eqn.primitive.name}'")
    return rule(eqn, side, axis)


def _size_at(eqn: JaxprEqn, side: Side, axis: int) -> int:
    atoms = eqn.invars if side[0] == "in" else eqn.outvars
    return _shape(atoms[side[1]])[axis]


# -- elementwise -----------------------------------------------------------------------------


@register(*ELEMENTWISE)
def _elementwise(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    out_shape = _shape(eqn.outvars[0])
    size = _size_at(eqn, side, axis)
    rank = len(out_shape)

    def carries(atom: Any) -> Axis:
        shape = _shape(atom)
        if len(shape) == rank and shape[axis] == size and size > 1:
            return axis
        if (len(shape) == rank and shape[axis] in (1, size)) or len(shape) == 0:
            return None
        raise NoRule(f"{eqn.primitive.name}: operand shape {shape} does not align with the axis")

    return Mapping(ins=tuple(carries(a) for a in eqn.invars), outs=tuple(axis for _ in eqn.outvars))


# -- shape and layout ------------------------------------------------------------------------


@register("broadcast_in_dim")
def _broadcast(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    if len(eqn.invars) != 1:
        raise NoRule("broadcast_in_dim with dynamic shapes")
    dims = eqn.params["broadcast_dimensions"]
    in_shape = _shape(eqn.invars[0])
    if side[0] == "in":
        return Mapping(ins=(axis,), outs=(dims[axis],))
    size = eqn.params["shape"][axis]
    for j, d in enumerate(dims):
        if d == axis and in_shape[j] == size:
            return Mapping(ins=(j,), outs=(axis,))
    return Mapping(ins=(None,), outs=(axis,))  # the axis is created here: regenerate per chunk


def _rebind_broadcast(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    shape = list(eqn.params["shape"])
    shape[m.outs[0]] = size
    return bind_eqn_with(eqn, invals, shape=tuple(shape))


REBINDERS["broadcast_in_dim"] = _rebind_broadcast


@register("reshape")
def _reshape(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    if eqn.params.get("dimensions") is not None or len(eqn.invars) != 1:
        raise NoRule("reshape with a dimension permutation or dynamic shape")
    in_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
    src, dst = (in_shape, out_shape) if side[0] == "in" else (out_shape, in_shape)
    before = _prod(src[:axis])
    size = src[axis]
    for k in range(len(dst)):
        if _prod(dst[:k]) == before and dst[k] == size:
            return Mapping(ins=(axis,), outs=(k,)) if side[0] == "in" else Mapping((k,), (axis,))
    raise NoRule(f"reshape {in_shape} -> {out_shape} merges or splits the axis")


def _rebind_reshape(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    sizes = list(eqn.params["new_sizes"])
    sizes[m.outs[0]] = size
    return bind_eqn_with(eqn, invals, new_sizes=tuple(sizes))


REBINDERS["reshape"] = _rebind_reshape


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= int(x)
    return out


@register("squeeze")
def _squeeze(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    dims = sorted(d % len(_shape(eqn.invars[0])) for d in eqn.params["dimensions"])
    kept = [d for d in range(len(_shape(eqn.invars[0]))) if d not in dims]
    if side[0] == "in":
        return Mapping(ins=(axis,), outs=(kept.index(axis),))
    return Mapping(ins=(kept[axis],), outs=(axis,))


@register("expand_dims")
def _expand_dims(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    rank = len(_shape(eqn.outvars[0]))
    dims = sorted(d % rank for d in eqn.params["dimensions"])
    kept = [d for d in range(rank) if d not in dims]
    if side[0] == "in":
        return Mapping(ins=(axis,), outs=(kept[axis],))
    return Mapping(ins=(kept.index(axis),), outs=(axis,))


@register("transpose")
def _transpose(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    perm = tuple(eqn.params["permutation"])
    if side[0] == "in":
        return Mapping(ins=(axis,), outs=(perm.index(axis),))
    return Mapping(ins=(perm[axis],), outs=(axis,))


@register("iota")
def _iota(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    return Mapping(ins=tuple(None for _ in eqn.invars), outs=(axis,))


def _rebind_iota(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    shape = list(eqn.params["shape"])
    shape[m.outs[0]] = size
    (out,) = bind_eqn_with(eqn, invals, shape=tuple(shape))
    if eqn.params["dimension"] == m.outs[0]:
        out = lax.add(out, lax.convert_element_type(start, out.dtype))
    return [out]


REBINDERS["iota"] = _rebind_iota


@register("random_bits")
def _random_bits(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    """Random bits are generated chunk by chunk (memsafe.split.random_bits)."""
    why = random_bits.why_not(eqn.invars[0].aval, tuple(eqn.params["shape"]))
    if why is not None:
        raise NoRule(why)
    return Mapping(ins=(None,), outs=(axis,))


def _rebind_random_bits(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    shape, width = tuple(eqn.params["shape"]), int(eqn.params["bit_width"])
    return [random_bits.chunk_bits(invals[0], shape, width, m.outs[0], start, size)]


REBINDERS["random_bits"] = _rebind_random_bits


@register("bitcast_convert_type")
def _bitcast(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    """Same-width bitcasts are elementwise; a width change adds or drops a last axis only."""
    rank_in, rank_out = len(_shape(eqn.invars[0])), len(_shape(eqn.outvars[0]))
    if axis >= min(rank_in, rank_out):
        raise NoRule("the split axis is the bytes axis of a bitcast")
    return Mapping(ins=(axis,), outs=(axis,))


def _identity_unless(param_axes: Callable[[JaxprEqn], Sequence[int]], what: str) -> Rule:
    """Rule for ops acting along some axes: the split axis passes if it is not among them."""

    def rule(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
        if axis in tuple(param_axes(eqn)):
            raise NoRule(f"{eqn.primitive.name} {what} along the split axis")
        rank = len(_shape(eqn.outvars[0]))
        ins = tuple(axis if len(_shape(a)) == rank else None for a in eqn.invars)
        return Mapping(ins=ins, outs=tuple(axis for _ in eqn.outvars))

    return rule


register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")(
    _identity_unless(lambda e: (e.params["axis"] % len(_shape(e.invars[0])),), "scans")
)
register("sort")(
    _identity_unless(lambda e: (e.params["dimension"] % len(_shape(e.invars[0])),), "sorts")
)
register("concatenate")(_identity_unless(lambda e: (e.params["dimension"],), "concatenates"))
register("split")(_identity_unless(lambda e: (e.params["axis"],), "splits"))
register("rev")(_identity_unless(lambda e: tuple(e.params["dimensions"]), "reverses"))


@register("pad")
def _pad(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    if tuple(eqn.params["padding_config"][axis]) != (0, 0, 0):
        raise NoRule("pad along the split axis")
    return Mapping(ins=(axis, None), outs=(axis,))


@register("slice")
def _slice(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    full = _shape(eqn.invars[0])[axis]
    start, limit = eqn.params["start_indices"][axis], eqn.params["limit_indices"][axis]
    strides = eqn.params["strides"]
    if start != 0 or limit != full or (strides is not None and strides[axis] != 1):
        raise NoRule("slice along the split axis")
    return Mapping(ins=(axis,), outs=(axis,))


def _rebind_slice(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    limits = list(eqn.params["limit_indices"])
    limits[m.ins[0]] = size
    return bind_eqn_with(eqn, invals, limit_indices=tuple(limits))


REBINDERS["slice"] = _rebind_slice


@register("dynamic_slice")
def _dynamic_slice(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    if eqn.params["slice_sizes"][axis] != _shape(eqn.invars[0])[axis]:
        raise NoRule("dynamic_slice along the split axis")
    return Mapping(ins=(axis,) + (None,) * (len(eqn.invars) - 1), outs=(axis,))


def _rebind_dynamic_slice(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    sizes = list(eqn.params["slice_sizes"])
    sizes[m.ins[0]] = size
    invals = list(invals)
    invals[1 + m.ins[0]] = lax.full_like(invals[1 + m.ins[0]], 0)  # a full slice starts at 0
    return bind_eqn_with(eqn, invals, slice_sizes=tuple(sizes))


REBINDERS["dynamic_slice"] = _rebind_dynamic_slice


@register("dynamic_update_slice")
def _dynamic_update_slice(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    op, upd = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    if op[axis] != upd[axis]:
        raise NoRule("dynamic_update_slice along the split axis")
    return Mapping(ins=(axis, axis) + (None,) * (len(eqn.invars) - 2), outs=(axis,))


def _rebind_dus(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    invals = list(invals)
    invals[2 + m.ins[0]] = lax.full_like(invals[2 + m.ins[0]], 0)
    return bind_eqn(eqn, invals)


REBINDERS["dynamic_update_slice"] = _rebind_dus


# -- reductions, contractions, top_k: sinks when they consume the axis -----------------------

REDUCE_KINDS = {
    "reduce_sum": "sum",
    "reduce_max": "max",
    "reduce_min": "min",
    "reduce_prod": "prod",
    "reduce_and": "and",
    "reduce_or": "or",
    "argmax": "argmax",
    "argmin": "argmin",
}


@register(*REDUCE_KINDS)
def _reduce(eqn: JaxprEqn, side: Side, axis: int) -> Mapping | Sink:
    axes = sorted(eqn.params["axes"])
    if side[0] == "in":
        if axis in axes:
            return Sink(REDUCE_KINDS[eqn.primitive.name], ins=(axis,))
        return Mapping(ins=(axis,), outs=(axis - sum(a < axis for a in axes),))
    kept = [d for d in range(len(_shape(eqn.invars[0]))) if d not in axes]
    return Mapping(ins=(kept[axis],), outs=(axis,))


@register("dot_general")
def _dot_general(eqn: JaxprEqn, side: Side, axis: int) -> Mapping | Sink:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    lrank, rrank = len(_shape(eqn.invars[0])), len(_shape(eqn.invars[1]))
    lfree = [d for d in range(lrank) if d not in lc and d not in lb]
    rfree = [d for d in range(rrank) if d not in rc and d not in rb]
    nb = len(lb)
    if side[0] == "out":
        if axis < nb:
            return Mapping(ins=(lb[axis], rb[axis]), outs=(axis,))
        if axis < nb + len(lfree):
            return Mapping(ins=(lfree[axis - nb], None), outs=(axis,))
        return Mapping(ins=(None, rfree[axis - nb - len(lfree)]), outs=(axis,))
    mine, other = (lc, rc) if side[1] == 0 else (rc, lc)
    mine_b, other_b = (lb, rb) if side[1] == 0 else (rb, lb)

    def pair(a: Axis, b: Axis) -> tuple[Axis, Axis]:
        return (a, b) if side[1] == 0 else (b, a)

    if axis in mine:
        return Sink("dot", ins=pair(axis, other[list(mine).index(axis)]))
    if axis in mine_b:
        p = list(mine_b).index(axis)
        return Mapping(ins=pair(axis, other_b[p]), outs=(p,))
    if side[1] == 0:
        return Mapping(ins=(axis, None), outs=(nb + lfree.index(axis),))
    return Mapping(ins=(None, axis), outs=(nb + len(lfree) + rfree.index(axis),))


@register("top_k")
def _top_k(eqn: JaxprEqn, side: Side, axis: int) -> Mapping | Sink:
    rank = len(_shape(eqn.invars[0]))
    along = eqn.params.get("axis", -1) % rank
    if side[0] == "in" and axis == along:
        return Sink("top_k", ins=(axis,))
    if axis == along:
        raise NoRule("top_k result along its own axis")
    return Mapping(ins=(axis,), outs=(axis, axis))


def _rebind_top_k(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    """A chunk of rows: the same top_k, through block maxima where its axis is long."""
    return list(topk.top_k(invals[0], int(eqn.params["k"]), axis=eqn.params.get("axis", -1)))


REBINDERS["top_k"] = _rebind_top_k


# -- gather / scatter along batch dimensions ------------------------------------------------


@register("gather")
def _gather(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    """Batch dimensions of a gather (``take_along_axis`` rows, embedding lookups by a chunked
    index array) and full-size offset dimensions pass; an operand axis indexed one position at a
    time by whole indices is a ``pick`` sink; other indexed dimensions stop the axis."""
    dn = eqn.params["dimension_numbers"]
    op_shape, idx_shape = _shape(eqn.invars[0]), _shape(eqn.invars[1])
    out_rank = len(_shape(eqn.outvars[0]))
    batch_out = [d for d in range(out_rank) if d not in dn.offset_dims]
    window = [
        d
        for d in range(len(op_shape))
        if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims
    ]

    def from_operand(a: int) -> Mapping:
        if a in dn.operand_batching_dims:
            j = dn.start_indices_batching_dims[list(dn.operand_batching_dims).index(a)]
            return Mapping(ins=(a, j), outs=(batch_out[j],))
        if (
            a in window
            and a not in dn.start_index_map
            and eqn.params["slice_sizes"][a] == op_shape[a]
        ):
            return Mapping(ins=(a, None), outs=(dn.offset_dims[window.index(a)],))
        if side == ("in", 0) and a in dn.collapsed_slice_dims and a in dn.start_index_map:
            # each result element picks one position of the axis: the chunk holding it supplies
            # it (``take_along_axis`` over the split axis, ``x[rows, cols]``)
            return Sink("pick", ins=(a, None))
        raise NoRule("gather indexes along the split axis")

    def from_indices(j: int) -> Mapping:
        if j == len(idx_shape) - 1:
            raise NoRule("gather index vectors cannot be split")
        if j in dn.start_indices_batching_dims:
            a = dn.operand_batching_dims[list(dn.start_indices_batching_dims).index(j)]
            return Mapping(ins=(a, j), outs=(batch_out[j],))
        return Mapping(ins=(None, j), outs=(batch_out[j],))

    if side == ("in", 0):
        return from_operand(axis)
    if side == ("in", 1):
        return from_indices(axis)
    if axis in dn.offset_dims:
        return from_operand(window[list(dn.offset_dims).index(axis)])
    return from_indices(batch_out.index(axis))


def _rebind_gather(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    a = m.ins[0]
    if a is not None and eqn.params["slice_sizes"][a] != 1:
        sizes = list(eqn.params["slice_sizes"])
        sizes[a] = size
        return bind_eqn_with(eqn, invals, slice_sizes=tuple(sizes))
    return bind_eqn(eqn, invals)


REBINDERS["gather"] = _rebind_gather


@register("scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter")
def _scatter(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    """Scatters pass the axis along their batching dimensions (the VJP of a batched gather) and
    along full-size window dimensions no index addresses (the VJP of a gather's offset axis)."""
    window = _scatter_window(eqn, side, axis)
    if window is not None:
        return window
    dn = eqn.params["dimension_numbers"]
    upd_rank = len(_shape(eqn.invars[2]))
    upd_scatter = [d for d in range(upd_rank) if d not in dn.update_window_dims]
    op_b, idx_b = list(dn.operand_batching_dims), list(dn.scatter_indices_batching_dims)
    if side[0] == "out" or side == ("in", 0):
        a = axis
        if a in dn.inserted_window_dims and a in dn.scatter_dims_to_operand_dims:
            # every update lands at one position of the axis: each chunk of the operand takes
            # those it holds (the VJP of a pick sink); indices and updates are read whole
            return Mapping(ins=(a, None, None), outs=(a,))
        if a not in op_b:
            raise NoRule("scatter along the split axis")
        j = idx_b[op_b.index(a)]
    elif side == ("in", 1):
        if axis not in idx_b:
            raise NoRule("scatter indices split along a non-batch axis")
        j, a = axis, op_b[idx_b.index(axis)]
    else:
        if axis not in upd_scatter:
            raise NoRule("scatter updates split along a window axis")
        j = upd_scatter.index(axis)
        if j not in idx_b:
            raise NoRule("scatter updates split along a non-batch axis")
        a = op_b[idx_b.index(j)]
    return Mapping(ins=(a, j, upd_scatter[j]), outs=(a,))


def chunk_local_indices(
    eqn: JaxprEqn, indices: Any, comp: int, axis: int, start: Any
) -> tuple[Any, Any]:
    """(global positions, indices made chunk-local) for component ``comp`` of a gather's or
    scatter's index vectors, which addresses operand ``axis``. Clipping modes clip the global
    position first (promise_in_bounds allows any result out of bounds); the caller then binds in
    fill-or-drop mode, so positions other chunks hold fall out of bounds."""
    pos = indices[..., comp]
    if eqn.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP:
        pos = jnp.clip(pos, 0, _shape(eqn.invars[0])[axis] - 1)
    local = pos - lax.convert_element_type(start, pos.dtype)
    return pos, indices.at[..., comp].set(local)


def _rebind_scatter(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    """A chunk of a scatter's operand along an axis the indices address: the positions are made
    chunk-local and updates landing in other chunks are dropped."""
    dn = eqn.params["dimension_numbers"]
    a = m.ins[0]
    if a is None or m.ins[1] is not None or a not in dn.scatter_dims_to_operand_dims:
        return bind_eqn(eqn, invals)
    operand, indices, updates = invals
    comp = list(dn.scatter_dims_to_operand_dims).index(a)
    _, shifted = chunk_local_indices(eqn, indices, comp, a, start)
    mode = lax.GatherScatterMode.FILL_OR_DROP
    return bind_eqn_with(eqn, [operand, shifted, updates], mode=mode)


for _name in ("scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter"):
    REBINDERS[_name] = _rebind_scatter


def _scatter_window(eqn: JaxprEqn, side: Side, axis: int) -> Mapping | None:
    """The mapping when the axis is a window dimension of the scatter spanning the whole operand
    axis, which no index vector addresses (so every chunk scatters into its own slice at 0)."""
    dn = eqn.params["dimension_numbers"]
    op_shape, upd_shape = _shape(eqn.invars[0]), _shape(eqn.invars[2])
    skipped = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    op_window = [d for d in range(len(op_shape)) if d not in skipped]
    pairs = list(zip(op_window, dn.update_window_dims))
    for a, u in pairs:
        hit = axis == (u if side == ("in", 2) else a) and side != ("in", 1)
        if hit and a not in dn.scatter_dims_to_operand_dims and upd_shape[u] == op_shape[a]:
            return Mapping(ins=(a, None, u), outs=(a,))
    return None


def rebind(eqn: JaxprEqn, invals: list[Any], mapping: Mapping, start: Any, size: int) -> list[Any]:
    """Evaluate ``eqn`` on chunk-shaped ``invals`` (chunk of ``size`` starting at ``start``)."""
    custom = REBINDERS.get(eqn.primitive.name)
    if custom is not None:
        return custom(eqn, invals, mapping, start, size)
    return bind_eqn(eqn, invals)


def literal_axis(atom: Any) -> bool:
    """Literals never carry the split axis (they are scalars in jaxprs)."""
    return isinstance(atom, Literal)


# -- linear algebra: batch dimensions, and the independent columns of triangular solves -------


def _batch_only(what: str) -> Rule:
    """Rule for a one-operand matrix op acting on the last two axes: batch axes pass."""

    def rule(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
        rank = len(_shape(eqn.invars[0]))
        if axis >= rank - 2:
            raise NoRule(f"{eqn.primitive.name} {what} along the split axis")
        return Mapping(ins=(axis,), outs=tuple(axis for _ in eqn.outvars))

    return rule


register("cholesky")(_batch_only("factorizes the matrix"))


@register("triangular_solve")
def _triangular_solve(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    """``op(a) x = b`` (left side) solves each column of ``b`` on its own, ``x op(a) = b`` each
    row: that axis of ``b`` passes to ``x`` with ``a`` used whole. Batch axes pass through both;
    the triangular system's own axis cannot be split."""
    rank = len(_shape(eqn.invars[1]))
    free = rank - 1 if eqn.params["left_side"] else rank - 2
    if axis < rank - 2:
        return Mapping(ins=(axis, axis), outs=(axis,))
    if side != ("in", 0) and axis == free:
        return Mapping(ins=(None, axis), outs=(axis,))
    raise NoRule("triangular_solve along the axis of its triangular system")
