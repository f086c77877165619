"""The chunk loop: one driver for every split region, with a pluggable carry.

A loop runs a *chunk body* (the region's equations at chunk shape) over the split axis: a
``lax.scan`` over the full chunks, whose first step's partial results start the carry (chosen by
the step, so no identity elements are needed) and whose later steps fold theirs in, then one
evaluation at the remainder's own static shape (no padding, so nothing foreign reaches a max or
a top_k). A body that reads the carry runs its first chunk before the scan (``_Chunks``).
Chunk bodies are wrapped in ``jax.checkpoint`` so that differentiating the emitted program does
not store every chunk's intermediates. Values the region hands back along the axis are written
into full buffers with ``dynamic_update_slice``.

What the loop carries between chunks is a :class:`Carry`: :class:`Fold` folds each sink's
partials with its reducer; the online-softmax carry (``memsafe.split.strategies.online``) also keeps
running maxima the body reads and rescales its accumulators.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from collections.abc import Mapping as Mapping_
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, Literal, Var
from memsafe.graph import Graph
from memsafe.split import peephole
from memsafe.split.region import Region
from memsafe.split.registry import Mapping, Running
from memsafe.split.sinks import Partial, Sink, finished
from memsafe.split.span import local_start, scaled

#: A chunk body: (chunk start, chunk length, operands, what it reads of the carry) ->
#: (partials of the chunk, values written along the axis).
Body = Callable[[Any, int, list[Any], Any], tuple[Any, list[Any]]]


class Carry:
    """What a loop keeps between chunks, and how a chunk's partials update it. ``reverse``: the
    loop visits the chunks last first (a scan from the end along the axis)."""

    reverse: bool = False

    @property
    def reads_state(self) -> bool:
        """Whether the chunk body reads the running state (see :meth:`feed`)."""
        return True

    def feed(self, state: Any) -> Any:
        """What the chunk body reads of the running state (None: nothing)."""
        return None

    def feed_in_loop(self, first: Any, state: Any) -> Any:
        """What a chunk reads of the state in a loop that runs the first chunk too (``first``:
        a traced bool, whether this is the first chunk, whose state is not yet made). Only for
        carries whose body reads a :class:`Started` (:attr:`starts_in_loop`)."""
        return None if not self.reads_state else Started(first, self.feed(state))

    @property
    def starts_in_loop(self) -> bool:
        """Whether the loop can run its first chunk like the others (see :meth:`_Chunks.in_loop`):
        the body reads nothing of the state, or reads a :class:`Started` and ignores the state
        on the first chunk."""
        return not self.reads_state

    def start(self, parts: Any) -> Any:
        """The state after the first chunk."""
        return parts

    def fold(self, state: Any, parts: Any) -> Any:
        """The state after a later chunk."""
        raise NotImplementedError

    def results(self, state: Any) -> list[Any]:
        """The loop's sink results from the final state."""
        raise NotImplementedError


@dataclass(frozen=True)
class Fold(Carry):
    """Each sink's partials folded by its reducer, and the last values of scans along the axis
    handed to the next chunk (the plain loop). The state is (partials, scan carries)."""

    sinks: tuple[tuple[JaxprEqn, Sink], ...]
    running: tuple[int, ...] = ()  # region equations carrying a value from chunk to chunk
    reverse: bool = False
    #: (position in ``running``, equation, its rule, result positions) of the scans whose
    #: results after the last chunk (a loop's final carry) at those positions are results of
    #: this loop.
    finals: tuple[tuple[int, JaxprEqn, Running, tuple[int, ...]], ...] = ()
    #: (equation, its rule) of each of ``running`` (to combine their carries across devices).
    rules: tuple[tuple[JaxprEqn, Running], ...] = ()

    @property
    def reads_state(self) -> bool:
        return bool(self.running)

    def feed(self, state: tuple) -> dict[int, Any]:
        return dict(zip(self.running, state[1]))

    def fold(self, state: tuple, parts: tuple) -> tuple:
        """Reducers fold the earlier positions' partials first (ties go to the first index)."""
        pairs = zip(self.sinks, state[0], parts[0])
        if self.reverse:
            folded = [s.reducer.fold(e, new, acc) for (e, s), acc, new in pairs]
        else:
            folded = [s.reducer.fold(e, acc, new) for (e, s), acc, new in pairs]
        return folded, parts[1]

    def results(self, state: tuple) -> list[Any]:
        sunk = [r for (e, s), a in zip(self.sinks, state[0]) for r in finished(s.reducer, e, a)]
        after = [
            run.finals(eqn, state[1][k])[p] for k, eqn, run, positions in self.finals
            for p in positions
        ]  # fmt: skip
        return sunk + after


@runtime_checkable
class Opening(Protocol):
    """What a runner hands a running equation in place of a carried value on a chunk that opens
    a run of chunks of its own (a device's first chunk, where the loop runs over devices:
    ``memsafe.split.strategies.sharded.mesh``): the operands that chunk reads, and nothing carried
    into it."""

    def operands(
        self, run: Running, eqn: JaxprEqn, invals: list[Any], mapping: Mapping
    ) -> list[Any]:
        """The operands of the opening chunk of ``eqn`` (a scan along the axis, ``run`` its
        rule) from its operands on the chunk ``invals``."""
        ...


@functools.partial(jax.tree_util.register_dataclass, data_fields=["first", "old"], meta_fields=[])
@dataclass(frozen=True)
class Started:
    """What a chunk reads of the running state in a loop that runs its first chunk too: on the
    first chunk (``first``, a traced bool) ``old`` is a placeholder the body must not use (it
    selects its own partials then, see :func:`first_or_folded`)."""

    first: Any
    old: Any


def first_or_folded(first: Any, part: Any, folded: Any) -> Any:
    """``part`` (a chunk's own partials) on the first chunk, ``folded`` (the running state
    folded with them) after it; elementwise selects, so the first chunk's values are exactly
    those of a chunk run before the loop, whatever the placeholder state made of ``folded``."""
    return jax.tree.map(lambda p, f: jnp.where(first, p, f), part, folded)


@dataclass(frozen=True)
class Written:
    """Values the loop writes chunk by chunk into full buffers."""

    values: tuple[Var, ...]
    axes: tuple[int, ...]
    #: Positions of each value per position of the loop's axis (empty: 1 each; see
    #: ``Span.scale_of``).
    scales: tuple[int, ...] = ()

    @classmethod
    def of(cls, values: Sequence[Var], axis_of: Mapping_[Var, int], scale_of: Any = None):
        scales = tuple(scale_of(v) for v in values) if scale_of is not None else ()
        return cls(tuple(values), tuple(axis_of[v] for v in values), scales)

    def scale(self, k: int) -> int:
        return self.scales[k] if self.scales else 1

    def write(self, bufs: list[Any], vals: list[Any], start: Any) -> list[Any]:
        return [
            lax.dynamic_update_slice_in_dim(
                b, v, local_start(scaled(start, self.scale(k)), b.shape[ax]), ax
            )
            for k, (b, v, ax) in enumerate(zip(bufs, vals, self.axes))
        ]


#: Runs a chunk body over the split axis: (body, axis size, chunk, operands, carry, written,
#: the split axis of each operand or None where it is read whole) -> (sink results, buffers).
#: :func:`run` runs it on one device; memsafe.split.strategies.sharded.mesh shards the axis over
#: devices (``memsafe.split.loop.DevicesRunner``).
Runner = Callable[..., tuple[list[Any], list[Any]]]


@runtime_checkable
class DevicesRunner(Protocol):
    """A chunk-loop runner (:data:`Runner`) over the devices of a mesh
    (memsafe.split.strategies.sharded.mesh.ShardedRun) that also runs any computation over each
    device's share of the axis."""

    @property
    def devices(self) -> int:
        """Devices sharing the axis, each over an equal share."""
        ...

    def __call__(
        self, body: Body, size: int, chunk: int, operands: list[Any], carry: Carry,
        written: Written, axes: Sequence[int | None] = (),
    ) -> tuple[list[Any], list[Any]]: ...  # fmt: skip

    def each(
        self,
        local: Callable[[list[Any], Any], Any],
        size: int,
        operands: list[Any],
        axes: Sequence[int | None],
        carry: Carry,
    ) -> Any:
        """``local(operands on this device, origin)``, a state of ``carry``, on every device
        over its share of positions ``[0, size)`` (``size`` a multiple of :attr:`devices`),
        combined across devices (``memsafe.split.strategies.sharded.mesh.combine``)."""
        ...


def operand_axes(
    axis_of: Mapping_[Var, int], sliced: Sequence[Var], whole: Sequence[Var]
) -> tuple[int | None, ...]:
    """What a :data:`Runner` takes of a loop's operands (``sliced``, then ``whole``): the split
    axis of each, None where it is read whole."""
    return (*(axis_of[v] for v in sliced), *(None for _ in whole))


def chunked(
    body: Body,
    size: int,
    chunk: int,
    operands: list[Any],
    carry: Carry,
    written: Written,
    origin: Any = 0,
    first_fed: Any = None,
) -> tuple[Any, list[Any]]:
    """Run ``body`` over positions ``[origin, origin + size)`` of the axis in chunks of
    ``chunk``, the first chunk reading ``first_fed`` (an :class:`Opening` per running equation,
    or None); (the carry's
    final state, written buffers of length ``size``)."""

    def at(n: int) -> Callable[..., tuple[Any, list[Any]]]:
        return jax.checkpoint(lambda start, ops, fed: body(start, n, ops, fed))

    origin = jnp.asarray(origin, jnp.int32)
    n_full, rem = divmod(size, chunk)

    def start_of(i: Any) -> Any:
        """Where the ``i``-th full chunk the loop visits starts (from the end in reverse)."""
        return origin + (size - (i + 1) * chunk if carry.reverse else i * chunk)

    chunks = _Chunks(at(chunk), n_full, start_of, operands, carry, written, size, first_fed)
    state, bufs = chunks.in_loop() if n_full > 1 and carry.starts_in_loop else chunks.peeled()
    if rem:
        start = origin + (0 if carry.reverse else n_full * chunk)
        parts, vals = at(rem)(start, operands, carry.feed(state))
        state, bufs = carry.fold(state, parts), written.write(bufs, vals, start)
    return state, bufs


@dataclass(frozen=True)
class _Chunks:
    """The ``n_full`` full chunks of a loop, run by ``full`` (a chunk body at chunk length)
    from ``start_of(i)``; each method returns (final state, written buffers of ``size``)."""

    full: Callable[..., tuple[Any, list[Any]]]
    n_full: int
    start_of: Callable[[Any], Any]
    operands: list[Any]
    carry: Carry
    written: Written
    size: int
    first_fed: Any = None  # what the first chunk reads (a device's first: Opening)

    def _empty(self, vals: Sequence[Any]) -> list[Any]:
        written = self.written
        return [
            jnp.zeros(_with_axis(v, ax, self.size * written.scale(k)), v.dtype)
            for k, (v, ax) in enumerate(zip(vals, written.axes))
        ]

    def peeled(self) -> tuple[Any, list[Any]]:
        """The first chunk before the loop (its partials start the carry), then a
        ``lax.scan`` over the others, each reading the carry."""
        carry, written = self.carry, self.written
        parts, vals = self.full(self.start_of(0), self.operands, self.first_fed)
        state = carry.start(parts)
        bufs = written.write(self._empty(vals), vals, self.start_of(0))
        if self.n_full < 2:
            return state, bufs

        def step(c: tuple[Any, list[Any]], i: Any) -> tuple[Any, list[Any]]:
            state, bufs = c
            start = self.start_of(i)
            parts, vals = self.full(start, self.operands, carry.feed(state))
            return carry.fold(state, parts), written.write(bufs, vals, start)

        return _counted_scan(step, (state, bufs), 1, self.n_full)

    def in_loop(self) -> tuple[Any, list[Any]]:
        """Every chunk of a body that reads nothing of the carry in one ``lax.scan``, each
        step alike: the first step's state is its partials, chosen by the step, later steps
        fold theirs in.

        The first chunk runs inside the loop, not before it: two regions that compute the same
        chunk (a forward and the backward that recomputes it) would otherwise each compute it
        at the top level, where XLA's CSE merges them and keeps the forward's chunk alive until
        the backward (the 4-block GPT gradient at L=4096: two 64 MiB values per layer, 889 MiB
        against a 512 MiB limit). ``lax.optimization_barrier`` does not stop that on the CPU
        (XLA expands it before CSE). A body that reads the carry reads a :class:`Started` (an
        online softmax's running maxima): on the first chunk it selects its own partials. A
        body that cannot (a scan along the axis) runs its first chunk before the loop
        (:meth:`peeled`): the same step under a ``lax.cond`` made the split of gradients of
        such loops explode (fuzz seed 422: over 400 s and 13 GB against 15 s)."""
        carry, written = self.carry, self.written

        def first(start: Any) -> tuple[Any, list[Any]]:
            parts, vals = self.full(start, self.operands, None)
            return carry.start(parts), vals

        state0, vals0 = jax.eval_shape(first, self.start_of(0))
        zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), state0)

        def step(c: tuple[Any, list[Any]], i: Any) -> tuple[Any, list[Any]]:
            state, bufs = c
            start = self.start_of(i)
            parts, vals = self.full(start, self.operands, carry.feed_in_loop(i == 0, state))
            pick = functools.partial(jnp.where, i == 0)
            state = jax.tree.map(pick, carry.start(parts), carry.fold(state, parts))
            return state, written.write(bufs, vals, start)

        return _counted_scan(step, (zeros, self._empty(vals0)), 0, self.n_full)


def apart(make: Callable[[], Any], operands: Sequence[Any]) -> Any:
    """``make()`` (buffers filled with a constant that a loop updates in place), made by a
    ``lax.cond`` on one element of each floating-point operand of the loop, whose branches
    both make them (the answer does not depend on the elements, NaN included).

    The same fill made before several loops is one buffer to XLA's CSE, kept to the last loop;
    every other loop that updates it in place first copies it, and XLA scheduled those copies
    at the program's start (a 3-round graph network's segment sums: the 3 fills and 6 copies
    alive at once, 9 x 55 KiB where one round needs 3). ``lax.optimization_barrier`` does not
    keep them apart on the CPU (XLA expands it before CSE); a conditional's results are
    buffers of their own, made once the loop's operands are (3 rounds of 3 segment reductions
    into 442 x 32 nodes: 442 KiB of temporaries instead of 781 KiB, under jax.jit too). Where
    no operand is a float, the fills are made as they are.

    Only the fills of scatters carried from chunk to chunk are made so (``strategies.staged``):
    made so too, the zeros a loop writes its chunks into and its first state took away the
    broadcasts a later split grows a region from (fuzz seed 142, a graph network's node update
    split along the nodes from such a broadcast, was refused then)."""
    elements = [
        o.reshape(-1)[0]
        for o in operands
        if hasattr(o, "dtype") and jnp.issubdtype(o.dtype, jnp.inexact) and math.prod(o.shape)
    ]
    if not elements:
        return make()
    same = functools.reduce(jnp.logical_and, [e == e for e in elements])
    return lax.cond(same, make, make)


def _counted_scan(step: Callable[[Any, Any], Any], init: Any, first: int, last: int) -> Any:
    """``carry = step(carry, i)`` for ``i`` in ``[first, last)`` as one ``lax.scan`` that carries
    the step number. Scanned over ``arange(first, last)`` instead, XLA stores that index array
    for the whole loop (fuzz seed 542: 196 bytes of a 1.8 KB budget, over it by 93)."""

    def counted(c: tuple[Any, Any], _: None) -> tuple[tuple[Any, Any], None]:
        i, inner = c
        return (i + 1, step(inner, i)), None

    (_, out), _ = lax.scan(counted, (jnp.int32(first), init), None, length=last - first)
    return out


def _with_axis(value: Any, axis: int, size: int) -> tuple[int, ...]:
    shape = list(value.shape)
    shape[axis] = size
    return tuple(shape)


def run(
    body: Body,
    size: int,
    chunk: int,
    operands: list[Any],
    carry: Carry,
    written: Written,
    axes: Sequence[int | None] = (),
) -> tuple[list[Any], list[Any]]:
    """Run ``body`` over ``size`` in chunks of ``chunk`` on one device; (sink results, written
    buffers). ``axes`` (where each operand carries the axis) is for sharded runners."""
    state, bufs = chunked(body, size, chunk, operands, carry, written)
    return carry.results(state), bufs


# -- evaluating region equations at chunk shape --------------------------------------------------


@dataclass
class ChunkEnv:
    """The values of one chunk body: chunk-shaped region values and values read whole. Region
    values hold the positions the chunk covers (``region.span``, :mod:`memsafe.split.span`):
    ``start`` and ``n`` are the covered ones, and sinks and written values take the chunk's own
    through the span.

    A chunk body evaluates its equations with :func:`memsafe.graph.interpret.evaluate_eqns`
    into this environment (it is the interpreter's :class:`~memsafe.graph.interpret.Values`),
    binding mapped equations with :meth:`step` and sinks with :meth:`partial`."""

    graph: Graph
    region: Region
    peep: peephole.Peepholes
    start: Any
    n: int
    local: dict[Any, Any]
    whole: dict[Any, Any]
    carried: dict[int, Any] | None = None  # scans' last values from the chunks before
    carries: dict[int, Any] = field(default_factory=dict)  # this chunk's last values

    @classmethod
    def slice_in(
        cls,
        graph: Graph,
        region: Region,
        peep: peephole.Peepholes,
        start: Any,
        n: int,
        sliced: Sequence[tuple[Var, Any]],
        whole: dict[Any, Any],
        carried: dict[int, Any] | None = None,
    ) -> ChunkEnv:
        """A body's environment with the positions chunk ``[start, start + n)`` covers of each
        sliced input (``region.span``)."""
        span = region.span
        start, n = span.cover(start, n)
        local = {
            v: span.read(val, region.axis_of[v], start, n, span.scale_of(v)) for v, val in sliced
        }
        return cls(graph, region, peep, start, n, local, whole, carried)

    def written(self, v: Var) -> Any:
        """The chunk's own positions of region value ``v``."""
        span = self.region.span
        return span.own(self.local[v], self.region.axis_of[v], self.n, span.scale_of(v))

    def read(self, atom: Any, ax: int | None) -> Any:
        if isinstance(atom, Literal):
            return atom.val
        return self.whole[atom] if ax is None else self.local[atom]

    def invals(self, i: int) -> list[Any]:
        """Operands of region equation ``i`` (None where a peephole moved the operand)."""
        eqn, m = self.graph.eqns[i], self.region.maps[i]
        moved = self.peep.norm.get(i, {})
        return [
            None if k in moved else self.read(a, ax)
            for k, (a, ax) in enumerate(zip(eqn.invars, m.ins))
        ]

    def operands(self, i: int, eqn: JaxprEqn) -> list[Any]:
        """Operands of equation ``i`` (:class:`memsafe.graph.interpret.Values`): a region
        equation's as :meth:`invals`, another's read whole."""
        if i in self.region.maps:
            return self.invals(i)
        return [self.read(a, None) for a in eqn.invars]

    def define(self, i: int, eqn: JaxprEqn, outs: Sequence[Any]) -> None:
        """Record equation ``i``'s results (:class:`memsafe.graph.interpret.Values`): a mapped
        equation's results along the axis at chunk shape, the others' (an equation outside the
        region, a sink's finished results) whole."""
        m = self.region.maps.get(i)
        if isinstance(m, Mapping):
            mapped = zip(eqn.outvars, outs, m.outs)
            self.local.update((o, v) for o, v, ax in mapped if ax is not None)
        else:
            self.whole.update(zip(eqn.outvars, outs))

    def partial(self, i: int, invals: list[Any]) -> Partial:
        """The partial result of sink ``i`` on this chunk, from its operands ``invals``."""
        sink = self.region.maps[i]
        assert isinstance(sink, Sink)
        eqn = self.graph.eqns[i]
        return sink.reducer.lift(self.region.span.partial(sink, eqn, invals, self.start, self.n))

    def pinned(self, i: int, outs: Sequence[Any]) -> list[Any]:
        """Equation ``i``'s results ``outs``, those along the axis of a floating-point dtype
        held behind ``lax.optimization_barrier``.

        A value that several loops recompute and one of them compares (the gradient of ``max``
        or ``segment_max`` compares each value with the maximum an earlier loop found) must
        have the same bits in every loop. XLA compiles each loop body on its own: a chain such
        as ``x * mask / 0.9 * gate`` was fused and simplified otherwise in the loop that found
        the maxima than in the loop that compared with them (a graph network's gradient, 37%
        off). Each pinned equation reads pinned operands or the loop's own inputs and feeds a
        barrier, so XLA sees it alone, the same in every loop, and rounds it the same."""
        m = self.region.maps[i]
        assert isinstance(m, Mapping)
        return [
            lax.optimization_barrier(v)
            if ax is not None and jnp.issubdtype(v.dtype, jnp.inexact)
            else v
            for v, ax in zip(outs, m.outs)
        ]

    def step(self, i: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
        """Mapped equation ``i`` at chunk shape on its operands ``invals`` (a ``bind`` of
        :func:`memsafe.graph.interpret.evaluate_eqns`); a scan along the axis reads what the
        chunks before it carried and records what it carries on."""
        m = self.region.maps[i]
        assert isinstance(m, Mapping)
        run = self.region.running(self.graph, i)
        prev = None if run is None or self.carried is None else self.carried.get(i)
        if isinstance(prev, Opening):  # a chunk that opens a run of its own (strategies.sharded)
            invals, prev = prev.operands(run, eqn, invals, m), None
        if prev is not None:
            invals = run.feed(eqn, invals, prev)
        k = self.region.span.scale_for(eqn, m)
        outs = peephole.bind_mapped(
            self.peep, i, eqn, invals, m, self.read, self.local, self.graph.eqns,
            scaled(self.start, k), self.n * k,
        )  # fmt: skip
        if run is not None:
            outs, self.carries[i] = run.record(eqn, outs, m, self.n, prev)
        return outs
