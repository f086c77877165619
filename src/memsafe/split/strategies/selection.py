"""A ``top_k`` along the split axis whose operand is computed tile by tile and never stored.

A chunk loop whose only work is a ``top_k`` along the axis (kNN: the distances of every query to
a chunk of points, then the k nearest) stores each chunk's operand. XLA's CPU backend runs a
product of that size at a third of its GEMM rate: 10,000 x 8,192 x 64 at 56 GFLOP/s where a
2048^3 product runs at 158 (jax 0.10.2, 2 cores, YNNPACK off). Computed in tiles of a few hundred
positions, each reduced at once, the same product runs at 140 GFLOP/s in a tile-sized buffer. So
such a loop runs in two passes:

1. Over the chunks, and inside each chunk over tiles: the operand of one tile, reduced to the
   maxima of blocks of ``block`` positions in ``top_k``'s total order
   (:func:`memsafe.split.topk.block_maxima`). Each chunk keeps the k best blocks of every row,
   merged with the loop's running k best (earlier blocks first on ties). A chunk stores only its
   block maxima, so it runs ``block / 4`` times the positions the plan chose for a stored chunk.
2. After the loop: each row's k blocks, recomputed for that row alone from its own slice of the
   operands and the blocks' positions of the others, and ``top_k`` of those ``k * block``
   candidates and of the last ``size % block`` positions, computed directly.

On a mesh (memsafe.split.strategies.sharded.mesh) each device runs both passes over its own share of
the axis and keeps its k best; the devices' results are merged in device order, then the positions
after the equal shares, as the sharded chunk loop merges a ``top_k``.

The argument of :mod:`memsafe.split.topk` makes this exact, ties included: only the k blocks with
the best maxima can hold a top-k element, and candidates keep their original order. The passes
compute the operand in different products (a tile's GEMM, a row's product with its gathered
columns), which XLA may round differently: two values within rounding of each other may be
ordered by either pass, as between any two compiles of the program.

A loop qualifies where the operand has two axes, the split one last; where its other axis (the
rows) maps through every equation computing it (:func:`memsafe.split.body.reach`); and where
nothing computing it depends on positions along the split axis (an ``iota``), since the
candidates are positions gathered per row.

:func:`plan` is a loop strategy (``memsafe.split.emit.LoopStrategy``), an entry of the planner's
``LOOPS``; :class:`FusedTopK` is the ``LoopPlan`` it returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from jax import lax

from memsafe import policy
from memsafe._jax import ClosedJaxpr, Var, eval_jaxpr
from memsafe.graph import Graph, evaluate_eqns
from memsafe.split import body as body_split
from memsafe.split import peephole, sinks, speed, topk
from memsafe.split.loop import (
    ChunkEnv,
    DevicesRunner,
    Fold,
    Runner,
    Written,
    chunked,
    operand_axes,
)
from memsafe.split.region import Region
from memsafe.split.registry import PLAIN, NoRule
from memsafe.split.sinks import Sink


class Loop(Protocol):
    """What this module reads of a stage of a region (``memsafe.split.emit.Loop``)."""

    eqns: tuple[int, ...]
    sinks: tuple[int, ...]
    threads: tuple[int, ...]
    sliced: tuple[Var, ...]
    whole: tuple[Var, ...]
    surviving: tuple[Var, ...]


def block_length(size: int, k: int) -> int | None:
    """Positions per block: ``policy.SPLIT.max_block``, or a shorter power of two (at least 8)
    where the axis holds too few blocks for ``k`` (None where even blocks of 8 are too few to
    pay)."""
    g = policy.SPLIT.max_block
    while g >= 8:
        if size // g >= policy.SPLIT.min_blocks_per_k * k:
            return g
        g //= 2
    return None


@dataclass(frozen=True)
class _Operand:
    """The loop's equations up to the ``top_k``'s operand, evaluated on any range of positions."""

    graph: Graph
    region: Region
    eqns: tuple[int, ...]
    sink: int
    sliced: tuple[Var, ...]
    whole: tuple[Var, ...]

    def at(self, start: Any, n: int, sliced: list[Any], whole: list[Any]) -> Any:
        """The operand over positions ``[start, start + n)`` of the full ``sliced`` operands."""
        env = ChunkEnv.slice_in(
            self.graph, self.region, self._peep(n), start, n,
            list(zip(self.sliced, sliced)), dict(zip(self.whole, whole)),
        )  # fmt: skip
        return self._run(env)

    def on(self, start: Any, local: list[Any], whole: list[Any]) -> Any:
        """The operand over positions held in ``local`` (the sliced operands, already cut)."""
        n = local[0].shape[self.region.axis_of[self.sliced[0]]]
        env = ChunkEnv(
            self.graph, self.region, self._peep(n), start, n,
            dict(zip(self.sliced, local)), dict(zip(self.whole, whole)),
        )  # fmt: skip
        return self._run(env)

    def _peep(self, n: int) -> peephole.Peepholes:
        return peephole.plan(self.graph, self.region, self.eqns, n)

    def _run(self, env: ChunkEnv) -> Any:
        order = [i for i in self.eqns if i != self.sink and i not in env.peep.skip]
        evaluate_eqns(self.graph.eqns, order, env, env.step)
        return env.invals(self.sink)[0]


@dataclass(frozen=True)
class FusedTopK:
    """A loop's ``top_k`` run in the two passes of the module doc."""

    operand: _Operand
    k: int
    block: int
    tile: int
    step: int  # positions per chunk of the loop: block maxima take 1/block of a chunk's operand
    rows_per_batch: int
    row_axes: tuple[int | None, ...]  # the row axis of each sliced, then whole, operand
    row_body: ClosedJaxpr  # the operand of one row: (row, start, *sliced cut, *whole cut)
    devices: int = 1  # devices sharing the axis (strategies.sharded), each over an equal share

    @property
    def share(self) -> int:
        """Positions each device selects from (one device: the whole axis); on a mesh the last
        ``size % devices`` positions come after the devices' results are merged."""
        return self.operand.region.size // self.devices

    @property
    def blocked(self) -> int:
        """Positions of a share in whole blocks: the loop runs over them, the rest of the share
        joins the candidates after it."""
        return self.share - self.share % self.block

    @property
    def loops(self) -> int:
        """Chunks the loop runs (on each device)."""
        return -(-self.blocked // self.step)

    def describe(self) -> str:
        """What the plan says of the loop, beside its chunks."""
        return (
            f"top_k in tiles of {self.tile} (block maxima of {self.block}, "
            "then each row's best blocks)"
        )

    def run(self, operands: list[Any], runner: Runner) -> list[Any]:
        """The ``top_k``'s values and indices from the loop's operands (sliced, then whole), its
        chunks run by ``runner`` (on a mesh: :meth:`_run_sharded`)."""
        if self.devices > 1:
            return self._run_sharded(operands, runner)
        op = self.operand
        n_sliced = len(op.sliced)
        axes = operand_axes(op.region.axis_of, op.sliced, op.whole)
        (_, ids), _ = runner(
            self._chunk_body, self.blocked, self.step, operands, self._carry(), Written((), ()),
            axes,
        )  # fmt: skip
        return list(self._finish(ids, operands[:n_sliced], operands[n_sliced:]))

    @property
    def _eqn(self) -> Any:
        return self.operand.graph.eqns[self.operand.sink]

    def _carry(self) -> Fold:
        return Fold(((self._eqn, Sink(sinks.TOP_K, (1,))),))

    def _chunk_body(self, start: Any, n: int, ops: list[Any], fed: Any) -> tuple[Any, list[Any]]:
        """First pass over one chunk: each row's k best blocks (global block numbers)."""
        del fed
        n_sliced = len(self.operand.sliced)
        maxima = self._maxima(start, n, ops[:n_sliced], ops[n_sliced:])
        vals, ids = topk.top_k(maxima, min(self.k, n // self.block))
        first = lax.div(start, jnp.int32(self.block)).astype(ids.dtype)
        return ([(vals, ids + first)], []), []

    def _run_sharded(self, operands: list[Any], runner: DevicesRunner) -> list[Any]:
        """Both passes on every device over its share, as on one device (``runner.each``,
        memsafe.split.strategies.sharded.mesh), the devices' k best merged in device order, then the
        positions after the equal shares (as the plain sharded loop runs them)."""
        op, eqn, carry = self.operand, self._eqn, self._carry()
        n_sliced = len(op.sliced)
        axes = operand_axes(op.region.axis_of, op.sliced, op.whole)

        def local(ops: list[Any], origin: Any) -> tuple:
            # positions from 0 in the device's own share: its block numbers, then shifted
            state, _ = chunked(self._chunk_body, self.blocked, self.step, ops, carry,
                               Written((), ()))  # fmt: skip
            _, ids = carry.results(state)
            return [self._finish(ids, ops[:n_sliced], ops[n_sliced:], origin)], []

        size, start = op.region.size, self.share * self.devices
        state = runner.each(local, start, operands, axes, carry)
        if start < size:
            tail = op.at(jnp.int32(start), size - start, operands[:n_sliced],
                         operands[n_sliced:])  # fmt: skip
            part = sinks.TOP_K.partial(eqn, [tail], 1, jnp.int32(start), size - start)
            state = carry.fold(state, ([part], []))
        return carry.results(state)

    def _maxima(self, start: Any, n: int, sliced: list[Any], whole: list[Any]) -> Any:
        """Block maxima of positions ``[start, start + n)``, tile by tile: (rows, n // block)."""
        n_tiles, rest = divmod(n, self.tile)

        def tile(at: Any, width: int) -> Any:
            op = self.operand.at(at, width, sliced, whole)
            return topk.block_maxima(op.reshape(op.shape[0], width // self.block, self.block))

        parts = []
        if n_tiles:
            tiles = jnp.arange(n_tiles, dtype=jnp.int32)
            stacked = lax.map(lambda t: tile(start + t * self.tile, self.tile), tiles)
            parts.append(jnp.moveaxis(stacked, 0, 1).reshape(stacked.shape[1], -1))
        if rest:
            parts.append(tile(start + n_tiles * self.tile, rest))
        return jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]

    def _finish(self, ids: Any, sliced: list[Any], whole: list[Any], origin: Any = 0) -> tuple:
        """``top_k`` of the chosen blocks' candidates, recomputed row by row, and of the share's
        positions after its whole blocks; ``ids`` and the operands are one share's, whose
        first position is ``origin`` on the axis."""
        cands, pos = self._candidates(ids, sliced, whole)
        share, blocked = self.share, self.blocked
        if blocked < share:
            tail = self.operand.at(jnp.int32(blocked), share - blocked, sliced, whole)
            tail_pos = jnp.broadcast_to(jnp.arange(blocked, share, dtype=pos.dtype), tail.shape)
            cands = jnp.concatenate([cands, tail], axis=1)
            pos = jnp.concatenate([pos, tail_pos], axis=1)
        vals, at = lax.top_k(cands, self.k)
        idx = jnp.take_along_axis(pos, at, axis=1) + jnp.asarray(origin, pos.dtype)
        return vals, idx.astype(self._eqn.outvars[1].aval.dtype)

    def _candidates(self, ids: Any, sliced: list[Any], whole: list[Any]) -> tuple[Any, Any]:
        """The operand at the chosen blocks ``ids`` of each row (block numbers in ``sliced``),
        recomputed row by row, and their positions in ``sliced``, in their original order."""
        rows, g = ids.shape[0], self.block
        ids = lax.sort(ids, dimension=1)  # candidates in their original order
        pos = (ids[:, :, None] * g + jnp.arange(g, dtype=ids.dtype)).reshape(rows, -1)

        def row(args: tuple[Any, Any]) -> Any:
            r, chosen = args
            axes = self.operand.region.axis_of
            n_sliced = len(sliced)
            gathered = [
                _windows(v, chosen, g, axes[s], r, a)
                for v, s, a in zip(sliced, self.operand.sliced, self.row_axes)
            ]
            cut = [_row_of(v, a, r) for v, a in zip(whole, self.row_axes[n_sliced:])]
            (out,) = eval_jaxpr(
                self.row_body.jaxpr, self.row_body.consts, r, jnp.int32(0),
                *gathered, *cut,
            )  # fmt: skip
            return out[0]

        cands = lax.map(
            row, (jnp.arange(rows, dtype=jnp.int32), ids), batch_size=self.rows_per_batch
        )
        return cands, pos


def _windows(value: Any, chosen: Any, g: int, axis: int, r: Any, row_axis: int | None) -> Any:
    """Blocks ``chosen`` (ascending) of ``g`` positions of ``value`` along ``axis``, in order, as
    one axis of ``len(chosen) * g`` positions; only row ``r`` (kept as an axis of length 1)
    where ``value`` carries the rows along ``row_axis``."""

    def window(b: Any) -> Any:
        starts, sizes = [jnp.int32(0)] * value.ndim, list(value.shape)
        starts[axis], sizes[axis] = (b * g).astype(jnp.int32), g
        if row_axis is not None:
            starts[row_axis], sizes[row_axis] = r.astype(jnp.int32), 1
        return lax.dynamic_slice(value, starts, sizes)

    windows = jnp.moveaxis(jax.vmap(window)(chosen), 0, axis)
    shape = list(windows.shape)
    shape[axis : axis + 2] = [shape[axis] * shape[axis + 1]]
    return windows.reshape(shape)


def _row_of(value: Any, axis: int | None, r: Any) -> Any:
    """Row ``r`` of ``value`` along ``axis``, kept as an axis of length 1 (None: all of it)."""
    return value if axis is None else lax.dynamic_slice_in_dim(value, r, 1, axis)


def plan(
    graph: Graph, region: Region, loop: Loop, chunk: int, devices: int = 1
) -> FusedTopK | None:
    """The fused form of ``loop`` (a stage of ``region`` run in chunks of ``chunk``, on each of
    ``devices`` sharing the axis), or None where it does not qualify (see the module doc) or
    cannot pay.

    The split pass asks twice for each split, to emit it and to record it: the last answer is
    kept (for the same graph and region objects: a new graph never reads an old answer)."""
    global _last
    last, asked = _last, (loop, chunk, devices)
    if last is not None and last[0] is graph and last[1] is region and last[2] == asked:
        return last[3]
    answer = _plan(graph, region, loop, chunk, devices)
    _last = (graph, region, asked, answer)  # one reference, swapped whole (compile threads)
    return answer


#: (graph, region, (loop, chunk, devices), answer) of the last :func:`plan`.
_last: tuple[Graph, Region, tuple, FusedTopK | None] | None = None


def _plan(graph: Graph, region: Region, loop: Loop, chunk: int, devices: int) -> FusedTopK | None:
    sink = _lone_top_k(graph, region, loop)
    if sink is None:
        return None
    eqn = graph.eqns[sink]
    operand_var = eqn.invars[0]
    rows, size = operand_var.aval.shape
    k = int(eqn.params["k"])
    g = block_length(size // devices, k)  # every device selects from its own share
    if g is None or rows < 1 or chunk < g or operand_var.aval.dtype == jnp.bool_:
        return None
    operand = _Operand(graph, region, loop.eqns, sink, loop.sliced, loop.whole)
    cone = _cone(operand, k * g)
    if cone is None:
        return None
    try:
        reached = body_split.reach(cone.jaxpr, {}, {0: 0}, PLAIN)
    except NoRule:
        return None
    ins = cone.jaxpr.invars[1:]
    row_axes = tuple(reached.axes.get(v) for v in ins)
    row_body = body_split.chunk_body(cone, reached, 1, [v.aval for v in cone.jaxpr.invars])
    itemsize = operand_var.aval.dtype.itemsize
    budget = rows * chunk * itemsize // policy.SPLIT.selection_share
    tile_bytes = speed.current().tile_bytes  # per backend (memsafe.split.speed)
    tile = min(max(g, tile_bytes // (rows * itemsize) // g * g), chunk - chunk % g)
    share = size // devices
    step = min(max(budget // (rows * itemsize) * g // tile * tile, k * g), share - share % g)
    per_row = k * g * (_column_bytes(region, loop.sliced, row_axes, rows) + 4 * itemsize)
    batch = int(min(rows, policy.SPLIT.row_batch, max(1, budget // max(per_row, 1))))
    return FusedTopK(operand, k, g, tile, step, batch, row_axes, row_body, devices)


def _lone_top_k(graph: Graph, region: Region, loop: Loop) -> int | None:
    """The loop's one sink where it is a ``top_k`` along the last axis of a matrix and the loop
    does nothing else (no values written along the axis, no scans along it)."""
    if len(loop.sinks) != 1 or loop.surviving or loop.threads or not loop.sliced:
        return None
    (sink,) = loop.sinks
    m = region.maps[sink]
    if not (isinstance(m, Sink) and m.reducer is sinks.TOP_K):
        return None
    eqn = graph.eqns[sink]
    if len(eqn.invars[0].aval.shape) != 2 or m.ins[0] != 1:
        return None
    if any(region.running(graph, i) is not None for i in loop.eqns):
        return None
    return sink


def _cone(operand: _Operand, n: int) -> ClosedJaxpr | None:
    """The operand over ``n`` positions as a jaxpr of (start, *sliced cut, *whole); None where
    it reads ``start`` (it depends on positions along the axis)."""
    region = operand.region

    def cut(v: Var) -> jax.ShapeDtypeStruct:
        shape = list(v.aval.shape)
        shape[region.axis_of[v]] = n
        return jax.ShapeDtypeStruct(tuple(shape), v.aval.dtype)

    avals = [cut(v) for v in operand.sliced] + [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in operand.whole
    ]
    n_sliced = len(operand.sliced)
    cone = jax.make_jaxpr(
        lambda start, *xs: [operand.on(start, list(xs[:n_sliced]), list(xs[n_sliced:]))]
    )(jax.ShapeDtypeStruct((), jnp.int32), *avals)
    start = cone.jaxpr.invars[0]
    if any(start in e.invars for e in cone.jaxpr.eqns) or start in cone.jaxpr.outvars:
        return None
    return cone


def _column_bytes(region: Region, sliced: tuple[Var, ...], row_axes: tuple, rows: int) -> int:
    """Bytes one position of the split axis takes in one row's cut of the sliced operands."""
    total = 0
    for v, ra in zip(sliced, row_axes):
        elems = math.prod(v.aval.shape) // max(v.aval.shape[region.axis_of[v]], 1)
        total += (elems // max(rows, 1) if ra is not None else elems) * v.aval.dtype.itemsize
    return total
