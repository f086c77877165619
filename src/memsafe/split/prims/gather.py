"""Gathers and scatters along batch dimensions, and gathers picking positions of the axis."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn, bind_eqn_with
from memsafe.split import sinks
from memsafe.split.indices import chunk_local_indices
from memsafe.split.registry import (
    Mapping,
    NoRule,
    RuleContext,
    Running,
    Side,
    shape,
    split_rule,
)
from memsafe.split.sinks import Sink

SCATTERS = (
    *("scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter"),
    *("scatter-max", "scatter_max", "scatter-min", "scatter_min"),
)


def _rebind_gather(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, size: int):
    a = m.ins[0]
    if a is not None and eqn.params["slice_sizes"][a] != 1:
        sizes = list(eqn.params["slice_sizes"])
        sizes[a] = size
        return bind_eqn_with(eqn, invals, slice_sizes=tuple(sizes))
    return bind_eqn(eqn, invals)


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


@split_rule("gather", rebind=_rebind_gather)
def _gather(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """Batch dimensions of a gather (``take_along_axis`` rows, embedding lookups by a chunked
    index array) and full-size offset dimensions pass; an operand axis indexed one position at a
    time by whole indices is a ``pick`` sink; other indexed dimensions stop the axis."""
    dn = eqn.params["dimension_numbers"]
    op_shape, idx_shape = shape(eqn.invars[0]), shape(eqn.invars[1])
    out_rank = len(shape(eqn.outvars[0]))
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
        if a in window and eqn.params["slice_sizes"][a] == op_shape[a]:
            # a window spanning the whole axis: its only in-bounds start is 0, on the whole
            # operand and on any chunk of it alike (an index along it clamps, or falls out of
            # bounds, in both), so the window passes the axis through
            return Mapping(ins=(a, None), outs=(dn.offset_dims[window.index(a)],))
        if side == ("in", 0) and a in dn.collapsed_slice_dims and a in dn.start_index_map:
            # each result element picks one position of the axis: the chunk holding it supplies
            # it (``take_along_axis`` over the split axis, ``x[rows, cols]``)
            return Sink(sinks.PICK, ins=(a, None))
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


@dataclass(frozen=True)
class Into(Mapping):
    """A combining scatter whose updates and indices are split along a scatter axis (``ins``:
    the operand whole, then the axis of the indices and of the updates), its result whole
    (``outs``: None): each chunk scatters its updates into the result of the chunks before it
    (:class:`ScatterRunning`)."""


class ScatterRunning(Running):
    """A combining scatter (``segment_sum``, ``segment_max``, the gradient of a gather) over
    chunks of its updates: the loop carries the scattered operand, and each chunk scatters its
    updates into what the chunks before it made, in place. The loop then holds one copy of the
    operand where folding per-chunk scatters held three (each chunk's identity-filled copy, its
    scattered copy and the fold: a graph network's node sums and minima over chunks of edges),
    and a sum adds the updates in the order one scatter over all of them does. Where nothing
    can be carried (a loop body run whole per chunk, pieces of a value) the scatter is the sink
    that folds per-chunk scatters (:class:`memsafe.split.sinks.ScatterInto`)."""

    def applies(self, eqn: JaxprEqn, mapping: Mapping) -> bool:
        return isinstance(mapping, Into)

    def feed(self, eqn: JaxprEqn, invals: list[Any], carried: Any) -> list[Any]:
        return [carried, *invals[1:]]

    def record(
        self, eqn: JaxprEqn, outs: list[Any], mapping: Mapping, size: int, carried: Any
    ) -> tuple[list[Any], Any]:
        return outs, outs[0]

    def finals(self, eqn: JaxprEqn, carried: Any) -> dict[int, Any]:
        return {0: carried}

    def keeping(self, eqn: JaxprEqn, mapping: Mapping, live: frozenset[int]) -> Running | None:
        return self if live else None

    def sink(self, eqn: JaxprEqn, mapping: Mapping) -> Sink:
        return Sink(sinks.SCATTER_INTO[eqn.primitive.name], ins=mapping.ins)

    def device_start(
        self, eqn: JaxprEqn, invals: list[Any], mapping: Mapping, first: Any
    ) -> list[Any]:
        """A device's first chunk scatters into the operand on the device holding the axis's
        first positions, into the combiner's identity on the others; with :meth:`across`,
        ``memsafe.split.strategies.sharded.mesh.Shardable``."""
        reducer = sinks.SCATTER_INTO[eqn.primitive.name]
        operand = invals[0]
        fill = jnp.full(operand.shape, reducer.identity(operand.dtype), operand.dtype)
        return [lax.select(jnp.full(operand.shape, first), operand, fill), *invals[1:]]

    def across(self, eqn: JaxprEqn, carried: Any, devices: Any) -> Any:
        """The devices' scattered operands folded by the combiner, in device order."""
        return devices.fold(sinks.SCATTER_INTO[eqn.primitive.name], eqn, (carried,))[0]


@split_rule(*SCATTERS, rebind=_rebind_scatter, running=ScatterRunning())
def _scatter(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """Scatters pass the axis along their batching dimensions (the VJP of a batched gather) and
    along full-size window dimensions no index addresses (the VJP of a gather's offset axis)."""
    window = _scatter_window(eqn, side, axis, ctx)
    if window is not None:
        return window
    dn = eqn.params["dimension_numbers"]
    upd_rank = len(shape(eqn.invars[2]))
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
        if axis == len(shape(eqn.invars[1])) - 1:
            raise NoRule("scatter index vectors cannot be split")
        if axis not in idx_b:
            return _into(eqn, axis, upd_scatter[axis], ctx)
        j, a = axis, op_b[idx_b.index(axis)]
    else:
        if axis not in upd_scatter:
            raise NoRule("scatter updates split along a window axis")
        j = upd_scatter.index(axis)
        if j not in idx_b:
            return _into(eqn, j, axis, ctx)
        a = op_b[idx_b.index(j)]
    return Mapping(ins=(a, j, upd_scatter[j]), outs=(a,))


def _into(eqn: JaxprEqn, index_axis: int, update_axis: int, ctx: RuleContext) -> Into | Sink:
    """Updates (and their indices) split along a scatter axis land anywhere in the operand
    (``segment_sum`` over chunks of edges, the gradient of a gather by chunks of indices): each
    chunk scatters into the running result (:class:`ScatterRunning`); on extended chunks
    (:mod:`memsafe.split.strategies.halo`), which carry nothing from chunk to chunk, a sink that
    scatters each chunk's updates and folds the results by the scatter's combiner."""
    reducer = sinks.SCATTER_INTO.get(eqn.primitive.name)
    if reducer is None:
        raise NoRule("scatter updates split along a non-batch axis (a scatter that overwrites)")
    ins = (None, index_axis, update_axis)
    return Sink(reducer, ins=ins) if ctx.extended else Into(ins=ins, outs=(None,))


def _scatter_window(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping | None:
    """The mapping when the axis is a window dimension of the scatter spanning the whole operand
    axis, which no index vector addresses (so every chunk scatters into its own slice at 0)."""
    dn = eqn.params["dimension_numbers"]
    op_shape, upd_shape = shape(eqn.invars[0]), shape(eqn.invars[2])
    skipped = set(dn.inserted_window_dims) | set(dn.operand_batching_dims)
    op_window = [d for d in range(len(op_shape)) if d not in skipped]
    pairs = list(zip(op_window, dn.update_window_dims))
    for a, u in pairs:
        hit = axis == (u if side == ("in", 2) else a) and side != ("in", 1)
        if hit and a not in dn.scatter_dims_to_operand_dims and upd_shape[u] == op_shape[a]:
            return Mapping(ins=(a, None, u), outs=(a,))
    return None
