"""Scaling past one device: the split axis sharded over a mesh with JAX's own SPMD.

With a mesh, ``memory_limit`` is per device. The split pass plans each top-level region as on
one device, but the region's loop runs inside ``jax.shard_map``: the values it slices along the
axis are sharded over the mesh (each device holds ``size // devices`` positions), the values it
reads whole are replicated, each device runs the ordinary chunk loop over its share (chunks
chosen from the per-device budget), and the sinks' running results are combined across devices
by :func:`combine` (sums and contractions with ``psum``, memsafe.split.strategies.sharded.devices;
max, min, argmax, argmin, top-k and picks gathered and folded in device order, so ties and NaN keep
the one-device answer; online-softmax accumulators rescaled to the merged maxima; a loop body's
sums over the axis, such as a scan over layers accumulating parameter gradients over the batch,
with ``psum``, the first device starting them from the loop's initial carry and the others from
zero). Values the region writes along the axis come back sharded. An axis that does not divide
evenly runs its last ``size % devices`` positions as one more chunk after the devices' results
are combined (replicated; no padding reaches a max or a top-k). Program inputs the sharded
loops slice are placed sharded along the axis; others are replicated.

On a mesh with several axes the loop may run over some of them only
(memsafe.split.strategies.sharded.layout): the others split an input the loop reads whole (a kNN's
queries while its database runs over the rest), the shard_map is manual over the loop's axes only
and XLA's SPMD partitioner runs each device's part of the input read whole.

Every device's footprint is what XLA's ``memory_analysis()`` of the SPMD program reports (per
device), verified against the limit like a one-device program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from memsafe._jax import JaxprEqn, context_mesh, nbytes_of_aval
from memsafe.errors import MemoryLimitError
from memsafe.graph import Graph
from memsafe.graph.interpret import Group
from memsafe.limits import format_bytes
from memsafe.split import loop as chunk_loop
from memsafe.split.emit import Split
from memsafe.split.loop import Body, Carry, Fold, Written
from memsafe.split.region import SplitFailure
from memsafe.split.registry import Mapping, Running
from memsafe.split.strategies.sharded import layout as mesh_layout
from memsafe.split.strategies.sharded.devices import DeviceAxis, collective
from memsafe.xla import Footprint

# -- what the split core's types do across devices ---------------------------------------------


@runtime_checkable
class Shardable(Protocol):
    """A running rule (``memsafe.split.registry.Running``) whose loop can run over devices, each
    over its share of the axis: a device's chunks then depend on its own earlier chunks only."""

    def device_start(
        self, eqn: JaxprEqn, invals: list[Any], mapping: Mapping, first: Any
    ) -> list[Any]:
        """The operands of a device's first chunk (``first``: a traced bool, whether this device
        holds the axis's first positions)."""
        ...

    def across(self, eqn: JaxprEqn, carried: Any, devices: DeviceAxis) -> Any:
        """The values every device carried out of its share, combined (inside ``shard_map``:
        ``devices`` names the mesh axis and folds partials in device order)."""
        ...


@runtime_checkable
class Combined(Protocol):
    """A loop carry of a strategy of its own (the online softmax's) that combines the states of
    several devices itself."""

    def across(self, state: Any, axis_name: Any, operands: list[Any]) -> Any:
        """The states of every device along mesh axis ``axis_name`` combined in device order
        (each device ran the loop over its share of the axis, so device order is chunk order).
        ``operands`` are the loop's operands on this device."""
        ...


@functools.partial(jax.tree_util.register_dataclass, data_fields=["first"], meta_fields=[])
@dataclass(frozen=True)
class DeviceStart:
    """What a running equation reads on a device's first chunk (``memsafe.split.loop.Opening``):
    its :class:`Shardable` rule's ``device_start``; a pytree (chunk bodies are traced under
    ``jax.checkpoint``)."""

    first: Any  # traced bool: the device holds the axis's first positions

    def operands(
        self, run: Running, eqn: JaxprEqn, invals: list[Any], mapping: Mapping
    ) -> list[Any]:
        assert isinstance(run, Shardable)
        return run.device_start(eqn, invals, mapping, self.first)


def first_feed(carry: Carry, first: Any) -> dict[int, Any] | None:
    """What a device's first chunk reads of ``carry`` (``first``: a traced bool, whether the
    device holds the axis's first positions): a :class:`DeviceStart` for each running equation
    of a plain loop; None where the loop carries nothing between chunks."""
    if isinstance(carry, Fold) and carry.running:
        return {i: DeviceStart(first) for i in carry.running}
    return None


def combine(carry: Carry, state: Any, axis_name: Any, operands: list[Any]) -> Any:
    """The states of ``carry`` of every device along mesh axis ``axis_name`` combined in device
    order (inside ``shard_map``; device order is chunk order). ``operands``: the loop's operands
    on this device."""
    if isinstance(carry, Combined):
        return carry.across(state, axis_name, operands)
    if not isinstance(carry, Fold):
        raise TypeError(f"{type(carry).__name__} cannot run over devices")
    devices = DeviceAxis(axis_name)
    parts = [devices.fold(s.reducer, e, p) for (e, s), p in zip(carry.sinks, state[0])]
    carried = [run.across(e, c, devices) for (e, run), c in zip(carry.rules, state[1])]
    return parts, carried


def resolve(mesh: Any, flat: Sequence[Any]) -> Mesh | None:
    """The mesh a call runs on: ``mesh`` if given, else the one set with ``jax.set_mesh``, else
    the mesh of the first argument placed with a ``NamedSharding``; None for one device.

    Raises:
        TypeError: ``mesh`` is not a ``jax.sharding.Mesh``.
    """
    if mesh is None:
        mesh = context_mesh()
    if mesh is None:
        mesh = next(
            (
                x.sharding.mesh
                for x in flat
                if isinstance(getattr(x, "sharding", None), NamedSharding)
                and x.sharding.mesh.size > 1
            ),
            None,
        )
    if mesh is None:
        return None
    if not isinstance(mesh, Mesh):
        raise TypeError(f"memsafe.jit: mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
    if mesh.size < 2:
        return None
    return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def _spec(axis: int | None, ndim: int, names: tuple[str, ...]) -> P:
    """The partition of a value carrying the split axis at ``axis`` over the mesh axes."""
    if axis is None:
        return P()
    parts: list[Any] = [None] * ndim
    parts[axis] = names if len(names) > 1 else names[0]
    return P(*parts)


@dataclass(frozen=True)
class MeshPlan:
    """The mesh one memsafe function runs on (its limit per device)."""

    mesh: Mesh

    @property
    def devices(self) -> int:
        return int(self.mesh.size)

    def given(self, avals: Sequence[Any], flat: Sequence[Any]) -> tuple[Any, ...]:
        """``avals`` placed as the arguments are (their ``NamedSharding`` on this mesh's
        devices) or else replicated: how the original program runs."""
        out = []
        for aval, x in zip(avals, flat):
            s = getattr(x, "sharding", None)
            spec = s.spec if self._on_this_mesh(s) else P()
            out.append(_placed(aval, NamedSharding(self.mesh, spec)))
        return tuple(out)

    def _on_this_mesh(self, s: Any) -> bool:
        """Whether ``s`` is a NamedSharding over this mesh's devices, in the same layout."""
        if not isinstance(s, NamedSharding) or s.mesh.devices.shape != self.mesh.devices.shape:
            return False
        same = s.mesh.axis_names == self.mesh.axis_names
        return same and bool((s.mesh.devices == self.mesh.devices).all())

    def check_fixed(self, before: Footprint, avals: Sequence[Any], limit: int, name: str) -> int:
        """Per-device bytes no rewrite can shrink at best (arguments and outputs split evenly
        over the devices); raises when even that exceeds the limit."""
        args = sum(nbytes_of_aval(a) for a in avals)
        least = -(-(args + before.outputs) // self.devices)
        if least > limit:
            raise MemoryLimitError(
                f"{name}: even sharded over the {self.devices} devices of the mesh, the "
                f"per-device share of its arguments and outputs needs {format_bytes(least)} "
                f"(arguments {format_bytes(args)}, outputs {format_bytes(before.outputs)} in all),"
                " more than the per-device limit",
                limit=limit,
                footprint=before.total,
            )
        return least

    def sharding(self) -> Sharding:
        """A fresh sharding state for one run of the pipeline."""
        return Sharding(self.mesh)


def _placed(aval: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(aval.shape, aval.dtype, sharding=sharding)


def place(flat: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    """The arguments moved to the placement the program was compiled for.

    An array already placed equivalently is passed as it is (``jax.device_put`` would reshard
    it with a compiled copy across processes when the spec is spelled differently). A NumPy
    array bound for devices of several processes is taken as this process's copy of the value
    (as ``jax.device_put`` takes it) and only its local shards are made: ``device_put`` would
    first check that every process holds the same value by gathering all their copies into
    each process (``multihost_utils.assert_equal``), a transient of ``processes`` times the
    array per process (+304 MiB for a 16 MiB database over 8 processes).
    """
    out = []
    for x, aval in zip(flat, avals):
        s = getattr(aval, "sharding", None)
        out.append(x if s is None else _put(x, aval, s))
    return out


def _put(x: Any, aval: Any, sharding: NamedSharding) -> Any:
    """``x`` placed with ``sharding`` (see :func:`place`)."""
    if isinstance(x, jax.Array):
        if x.sharding.is_equivalent_to(sharding, x.ndim):
            return x
        return jax.device_put(x, sharding)
    if isinstance(x, np.ndarray) and not sharding.is_fully_addressable:
        host = np.asarray(x, dtype=aval.dtype)
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
    return jax.device_put(x, sharding)


@dataclass
class Sharding:
    """The state of one pipeline run on a mesh (``PassContext.mesh``): shards the splits the
    pass chooses, and records where the program inputs they read must be placed."""

    mesh: Mesh
    placements: dict[int, P] = field(default_factory=dict)

    @property
    def devices(self) -> int:
        return int(self.mesh.size)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.mesh.axis_names)

    def shard(self, graph: Graph, split: Split) -> Sharded:
        """``split`` with its axis sharded over the mesh axes
        memsafe.split.strategies.sharded.layout chooses; raises SplitFailure."""
        region = split.region
        layout = mesh_layout.choose(graph, region, self.mesh)
        if region.size < layout.devices:
            raise SplitFailure(f"the axis ({region.size}) is shorter than the mesh")
        for i in region.maps:
            run = region.running(graph, i)
            if run is not None and not isinstance(run, Shardable):
                raise SplitFailure(
                    "a scan along the axis cannot be sharded over devices", graph.eqns[i]
                )
        return Sharded(split, self, layout)

    def placed(self, avals: Sequence[Any]) -> tuple[Any, ...]:
        """``avals`` with the placement the sharded loops want (others replicated)."""
        return tuple(
            _placed(a, NamedSharding(self.mesh, self.placements.get(i, P())))
            for i, a in enumerate(avals)
        )

    def record(self, graph: Graph, split: Split, layout: mesh_layout.Layout) -> None:
        """Program inputs ``split`` slices: placed sharded along the split axis over the
        layout's manual mesh axes where their devices divide it, else along the longest axis
        they divide (XLA moves the rows to the devices that run them), else replicated.
        Program inputs it reads whole: along their longest axis the batch mesh axes divide."""
        inputs = list(graph.inputs)
        region = split.region
        for v in region.sliced:
            if v not in inputs:
                continue
            shape = v.aval.shape
            axis: int | None = region.axis_of[v]
            if shape[axis] % layout.devices:
                axis = mesh_layout.batch_axis(shape, layout.devices)
            self.placements.setdefault(inputs.index(v), _spec(axis, len(shape), layout.manual))
        for v in region.whole:
            axis = mesh_layout.batch_axis(v.aval.shape, layout.batch_devices)
            if v in inputs and axis is not None:
                spec = _spec(axis, len(v.aval.shape), layout.batch)
                self.placements.setdefault(inputs.index(v), spec)


@dataclass(frozen=True)
class Sharded:
    """A split whose axis is sharded over mesh axes, each device looping over its share."""

    inner: Split
    sharding: Sharding
    layout: mesh_layout.Layout
    cost_weight: ClassVar[float] = 1.0

    @property
    def region(self) -> Any:
        return self.inner.region

    @property
    def label(self) -> str | None:
        return self.inner.label

    @property
    def mesh_axes(self) -> tuple[str, ...]:
        return self.layout.manual

    @property
    def batch_mesh_axes(self) -> tuple[str, ...]:
        """Mesh axes splitting the inputs the loop reads whole (XLA partitions the loop)."""
        return self.layout.batch

    @property
    def devices(self) -> int:
        return self.layout.devices

    @property
    def share(self) -> int:
        return self.region.size // self.devices

    def fixed_bytes(self, graph: Graph) -> int:
        """The inner split's, and what combining the devices' partials holds: a sink reduced
        by a collective (``psum``) its result and the reduced copy, any other every device's
        partials gathered and the fold's result."""
        eqns = graph.eqns
        total = self.inner.fixed_bytes(graph)
        for i, sink in self.region.sinks.items():
            outs = sum(graph.info(o).bytes for o in eqns[i].outvars)
            reduced = collective(sink.reducer) is not None
            total += 2 * outs if reduced else 2 * self.devices * outs
        return total

    def groups(
        self, graph: Graph, chunk: int, runner: chunk_loop.Runner = chunk_loop.run
    ) -> list[Group]:
        """The inner split's groups, each loop run sharded over the mesh."""
        self.sharding.record(graph, self.inner, self.layout)
        return self.inner.groups(graph, chunk, ShardedRun(self.layout))


@dataclass(frozen=True)
class ShardedRun:
    """A chunk-loop runner (memsafe.split.loop.DevicesRunner) over the devices of a mesh:
    manual over the layout's manual axes, its batch axes left to XLA's partitioner."""

    layout: mesh_layout.Layout

    @property
    def devices(self) -> int:
        return self.layout.devices

    def __call__(
        self,
        body: Body,
        size: int,
        chunk: int,
        operands: list[Any],
        carry: Carry,
        written: Written,
        axes: Sequence[int | None] = (),
    ) -> tuple[list[Any], list[Any]]:
        share = size // self.devices
        out_bufs = [
            _spec(ax, len(v.aval.shape), self.layout.manual)
            for v, ax in zip(written.values, written.axes)
        ]

        def per_device(ops: list[Any], origin: Any) -> tuple[Any, list[Any]]:
            fed = first_feed(carry, origin == 0)  # the first device starts from the loop's start
            state, bufs = chunk_loop.chunked(body, share, chunk, ops, carry, written, origin, fed)
            return combine(carry, state, self.layout.manual, ops), bufs

        state, bufs = self._on_shares(per_device, share, operands, axes, (P(), out_bufs))
        rest = size % self.devices
        if rest:
            state, bufs = _last(body, size - rest, rest, operands, carry, written, state, bufs)
        return carry.results(state), bufs

    def each(
        self,
        local: Callable[[list[Any], Any], Any],
        size: int,
        operands: list[Any],
        axes: Sequence[int | None],
        carry: Carry,
    ) -> Any:
        def per_device(ops: list[Any], origin: Any) -> Any:
            return combine(carry, local(ops, origin), self.layout.manual, ops)

        return self._on_shares(per_device, size // self.devices, operands, axes, P())

    def _on_shares(
        self,
        per_device: Callable[[list[Any], Any], Any],
        share: int,
        operands: list[Any],
        axes: Sequence[int | None],
        out_specs: Any,
    ) -> Any:
        """``per_device(operands on this device, origin)`` under ``jax.shard_map``: the operands
        sliced along the axis cut to the devices' equal shares of ``share`` and sharded, the
        others read whole (split over the batch mesh axes by XLA)."""
        names = self.layout.manual
        main = [
            self._batched(op) if ax is None else _cut(op, ax, share * self.devices)
            for op, ax in zip(operands, axes)
        ]
        in_specs = tuple(_spec(ax, jnp.ndim(op), names) for op, ax in zip(operands, axes))

        def run(*ops: Any) -> Any:
            return per_device(list(ops), lax.axis_index(names) * share)

        return jax.shard_map(
            run,
            mesh=self.layout.mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            axis_names=frozenset(names),
            check_vma=False,
        )(*main)

    def _batched(self, op: Any) -> Any:
        """An operand the loop reads whole, split over the layout's batch mesh axes along its
        longest axis they divide (XLA's partitioner runs each device's part)."""
        axis = mesh_layout.batch_axis(jnp.shape(op), self.layout.batch_devices)
        if axis is None:
            return op
        spec = _spec(axis, jnp.ndim(op), self.layout.batch)
        return lax.with_sharding_constraint(op, NamedSharding(self.layout.mesh, spec))


def _cut(op: Any, axis: int, n: int) -> Any:
    """The first ``n`` positions of ``op`` along ``axis`` (the devices' equal shares)."""
    return op if jnp.shape(op)[axis] == n else lax.slice_in_dim(op, 0, n, axis=axis)


def _last(
    body: Body,
    start: int,
    n: int,
    operands: list[Any],
    carry: Carry,
    written: Written,
    state: Any,
    bufs: list[Any],
) -> tuple[Any, list[Any]]:
    """The positions after the devices' equal shares, as one more chunk (on every device)."""
    run = jax.checkpoint(lambda s, ops, fed: body(s, n, ops, fed))
    parts, vals = run(jnp.int32(start), operands, carry.feed(state))
    bufs = [lax.concatenate([b, v], ax) for b, v, ax in zip(bufs, vals, written.axes)]
    return carry.fold(state, parts), bufs
