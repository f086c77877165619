"""Halos: the input positions a chunk of a windowed operation's output reads.

A windowed operation (a convolution, a pooling ``reduce_window``) reads, for output chunk ``[a, a
+ n)``, a range of its padded operand that overlaps its neighbours' (the halo;
:class:`memsafe.split.window.Window`). :meth:`~memsafe.split.window.Window.read` takes that range
of the whole operand, so the operation run on it gives exactly the chunk's outputs.

That reads the operand whole: one layer at a time. Several windowed layers in a row (a stack of 3x3
convolutions over one large image) run in one region on *extended chunks* instead: while the split
rules are told so (``RuleContext.extended``), a windowed operation whose operand is ``stride`` times
as long as its result along the axis (stride 1 with "SAME"-like padding, a 2x2 pooling of an even
axis) maps the axis through (a :class:`Halo`), and every region value is
computed over ``[start - E, start + n + E)`` for the chunk ``[start, start + n)``. Each windowed
operation fills the positions of its operand outside the axis with its padding value and runs
unchanged, so its outputs are exact except within its window's reach of the chunk's ends; positional
operations (elementwise, broadcasts, contractions of other axes) keep each position to itself. With
``E`` the most reach any chain of windows adds up to (:func:`extension`), the centre ``[start, start
+ n)`` is exact: sinks and written values take only the centre.

Where strides make values of several lengths, the region's axis is their greatest common divisor
(:func:`scales`): a value ``k`` times as long holds positions ``[k * (start - E), k * (start + n
+ E))`` of its own axis.

The core knows none of this: a region grows on extended chunks through :data:`EXTENDED` (a
``memsafe.split.span.Spanning`` the planner tries first, ``planner.SPANS``) and runs on an
:class:`Extended` span, which reads, centres and reduces each value's chunk for the chunk
environment (``memsafe.split.span.Span``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, Var, is_var
from memsafe.graph import Graph
from memsafe.primitives import WINDOWED
from memsafe.split import registry
from memsafe.split.region import SplitFailure
from memsafe.split.sinks import Partial, Reducer, Sink
from memsafe.split.span import PLAIN_SPAN, Span, scaled
from memsafe.split.window import Window, positions, reach

Axis = int | None


def lengths_agree(eqn: JaxprEqn, m: registry.Mapping) -> bool:
    """Whether the operands and results a mapping splits have lengths along the axis it can run
    chunk for chunk: a :class:`Halo`'s own (:meth:`Halo.lengths_agree`), else all equally long."""
    ins = [a.aval.shape[ax] if ax is not None else None for a, ax in zip(eqn.invars, m.ins)]
    outs = [o.aval.shape[ax] if ax is not None else None for o, ax in zip(eqn.outvars, m.outs)]
    if isinstance(m, Halo):
        return m.lengths_agree(ins, outs)
    return len({n for n in (*ins, *outs) if n is not None}) <= 1


def wrong_after(m: registry.Mapping, ins: Sequence[int | None]) -> int:
    """Positions at each end of an extended chunk of the results of an equation mapped as ``m``
    that may be wrong, given those of its split operands (None: not split): a :class:`Halo`'s
    own (:meth:`Halo.wrong_after`), else the most of the operands' (each result position
    reads its own position of each operand)."""
    return m.wrong_after(ins) if isinstance(m, Halo) else _most_wrong(ins)


def _most_wrong(ins: Sequence[int | None]) -> int:
    return max((w for w in ins if w is not None), default=0)


def scales(lengths: Mapping[Var, int]) -> tuple[int, dict[Var, int]]:
    """(the region's axis length, each longer value's multiple of it) from every region value's
    length along the axis (a pooling halves it): the axis runs over their greatest common
    divisor, so that a chunk of it is whole positions of every value."""
    size = math.gcd(*lengths.values())
    return size, {v: n // size for v, n in lengths.items() if n != size}


def extension(
    eqns: Sequence[JaxprEqn],
    maps: Mapping[int, Any],
    surviving: Sequence[Var],
    scale: Mapping[Var, int],
) -> int:
    """``E``: how far each chunk must extend on both sides (in positions of the region's axis)
    for its centre to be exact.

    Walks the region's equations (``maps``: index -> Mapping or Sink) in program order, tracking
    how many positions at each end of an extended chunk of every value may be wrong, in the
    value's own positions (:func:`wrong_after`: a :class:`Halo` adds
    its reach and divides by its stride, other mappings keep the most of their operands'). Sinks
    (plus the reach of a sink that reads a window of an operand, :func:`sink_reach`) and
    written values need their operands exact at the centre, ``scale`` of a value's positions to
    one of the region's axis."""
    wrong: dict[Var, int] = {}

    def units(rows: int, v: Any) -> int:
        return -(-rows // scale.get(v, 1))

    need = 0
    for i in sorted(maps):
        eqn, m = eqns[i], maps[i]
        ins = [wrong.get(a, 0) if ax is not None else None for a, ax in zip(eqn.invars, m.ins)]
        if not hasattr(m, "outs"):  # a sink
            reach = sink_reach(m.reducer, eqn, m.ins)
            for k, (a, w) in enumerate(zip(eqn.invars, ins)):
                if w is not None:
                    need = max(need, units(w + reach.get(k, 0), a))
            continue
        after = wrong_after(m, ins)
        wrong.update((o, after) for o, ax in zip(eqn.outvars, m.outs) if ax is not None)
    return max([need, *(units(wrong.get(v, 0), v) for v in surviving)])


def read_extended(x: Any, axis: int, start: Any, n: int) -> Any:
    """Positions ``[start, start + n)`` of ``x`` along ``axis``; those outside ``x`` repeat its
    nearest end (no windowed operation reads them: each fills them, :func:`fill_outside`)."""
    index = jnp.clip(positions(start, n), 0, x.shape[axis] - 1)
    return jnp.take(x, index, axis=axis)


def fill_outside(x: Any, axis: int, start: Any, size: int, fill: Any) -> Any:
    """``x``, an extended chunk starting at global position ``start``, with ``fill`` at the
    positions outside ``[0, size)``."""
    q = positions(start, x.shape[axis])
    keep = lax.broadcast_in_dim((q >= 0) & (q < size), x.shape, (axis,))
    return lax.select(keep, x, jnp.broadcast_to(jnp.asarray(fill, x.dtype), x.shape))


def centre(x: Any, axis: int, extend: int, n: int) -> Any:
    """The chunk's own ``n`` positions of an extended chunk (``extend`` on each side)."""
    return lax.slice_in_dim(x, extend, extend + n, axis=axis)


@dataclass(frozen=True)
class Halo(registry.Mapping):
    """A windowed equation run on an extended chunk: output position ``o`` reads positions ``o *
    stride - lo`` to ``o * stride + hi`` of its operand dilated by ``dilation`` (operand position
    ``i`` at ``i * dilation``) along the split axis; the operand is ``stride / dilation`` times as
    long as the result (one of them is 1)."""

    lo: int = 0
    hi: int = 0
    stride: int = 1
    dilation: int = 1

    @classmethod
    def over(cls, window: Window, ins: tuple[Axis, ...], outs: tuple[Axis, ...]) -> Halo:
        """The halo of ``window`` (its padding, stride and base dilation)."""
        lo, hi = window.pad_lo, window.after
        return cls(ins, outs, lo=lo, hi=hi, stride=window.stride, dilation=window.base_dilation)

    def lengths_agree(self, ins: Sequence[int | None], outs: Sequence[int | None]) -> bool:
        """Operands ``stride / dilation`` times as long as the results."""
        dilated = {self.dilation * n for n in ins if n is not None}
        return len(dilated | {self.stride * n for n in outs if n is not None}) <= 1

    def wrong_after(self, ins: Sequence[int | None]) -> int:
        """A result position is wrong where its window reads a wrong operand position."""
        wrong = self.dilation * _most_wrong(ins)
        return -(-(wrong + self.reach) // self.stride)

    def whole_units(self, eqn: JaxprEqn, size: int) -> bool:
        """Whether a chunk of whole positions of a region axis of length ``size`` is a chunk
        this equation can run on (a grouped convolution's: whole groups)."""
        return True

    def operand_start(self, start: Any) -> Any:
        """Where the operand's chunk starts along its axis, given where the result's does (both
        whole multiples of the region's chunk positions)."""
        return start if self.stride == self.dilation else start * self.stride // self.dilation

    @property
    def reach(self) -> int:
        """Operand positions beyond a chunk's own (``[o * stride, (o + 1) * stride)`` for each
        output ``o``) that a window reads, on the farther side."""
        return reach(self.lo, self.hi, self.stride)


@runtime_checkable
class Windowed(Protocol):
    """A reducer whose sink reads a window of an operand's extended chunk, beyond the chunk's
    centre (a kernel gradient's taps): :func:`sink_reach` and :func:`extended_partial` ask it.
    Other reducers read the centres of their operands."""

    def halo_reach(self, eqn: JaxprEqn, ins: tuple[Axis, ...]) -> dict[int, int]:
        """Positions beyond the centre of an extended chunk that :meth:`extended_partial`
        reads, by operand position."""
        ...

    def extended_partial(
        self,
        eqn: JaxprEqn,
        invals: list[Any],
        ins: tuple[Axis, ...],
        scales: tuple[int, ...],
        start: Any,
        size: int,
        extend: int,
    ) -> Partial:
        """The result on chunk ``[start, start + size)`` from operands that hold an extended
        chunk (see :func:`extended_partial`)."""
        ...


def sink_reach(reducer: Reducer, eqn: JaxprEqn, ins: tuple[Axis, ...]) -> dict[int, int]:
    """Positions beyond the centre of an extended chunk that the sink ``eqn`` reads, by operand
    position: a :class:`Windowed` reducer's own, else none (it reads the centres)."""
    return reducer.halo_reach(eqn, ins) if isinstance(reducer, Windowed) else {}


def extended_partial(
    reducer: Reducer,
    eqn: JaxprEqn,
    invals: list[Any],
    ins: tuple[Axis, ...],
    scales: tuple[int, ...],
    start: Any,
    size: int,
    extend: int,
) -> Partial:
    """The sink's result on chunk ``[start, start + size)`` of the region's axis from operands
    split along ``ins`` that hold an extended chunk (``extend`` more positions on each side; each
    operand ``scales`` positions per position of the axis): a :class:`Windowed` reducer's own,
    else ``reducer.partial`` of the operands' centres."""
    if isinstance(reducer, Windowed):
        return reducer.extended_partial(eqn, invals, ins, scales, start, size, extend)
    invals = [
        v if ax is None else centre(v, ax, k * extend, k * size)
        for v, ax, k in zip(invals, ins, scales)
    ]
    k, axis = next((k, a) for k, a in zip(scales, ins) if a is not None)
    return reducer.partial(eqn, invals, axis, scaled(start, k), size * k)


def runs_extended(eqn: JaxprEqn, mapping: registry.Mapping) -> bool:
    """Whether ``eqn``, mapped as ``mapping``, runs unchanged on an extended chunk: a windowed
    equation's :class:`Halo`, or a positional rule's that carries nothing from chunk to chunk."""
    return isinstance(mapping, Halo) or registry.positional(eqn, mapping)


@dataclass(frozen=True)
class Extended:
    """The span of a region on extended chunks (a ``memsafe.split.span.Span``): chunk ``[start,
    start + n)`` covers ``[start - extend, start + n + extend)``, of a value ``k`` times as long
    as the axis (``scale``; 1 where absent) ``k`` times those positions."""

    extend: int
    scale: dict[Var, int]
    plain: ClassVar[bool] = False

    def scale_of(self, v: Var) -> int:
        return self.scale.get(v, 1)

    def scale_for(self, eqn: JaxprEqn, mapping: registry.Mapping) -> int:
        if not self.scale:  # every value as long as the axis
            return 1
        pairs = [*zip(eqn.outvars, mapping.outs), *zip(eqn.invars, mapping.ins)]
        return next((self.scale_of(a) for a, ax in pairs if ax is not None), 1)

    def cover(self, start: Any, n: int) -> tuple[Any, int]:
        e = self.extend
        return (start - e, n + 2 * e) if e else (start, n)

    def read(self, value: Any, axis: int, start: Any, n: int, scale: int) -> Any:
        return read_extended(value, axis, scaled(start, scale), n * scale)

    def own(self, value: Any, axis: int, n: int, scale: int) -> Any:
        e = self.extend
        return centre(value, axis, scale * e, scale * (n - 2 * e)) if e else value

    def partial(self, sink: Sink, eqn: JaxprEqn, invals: list[Any], start: Any, n: int) -> Partial:
        e = self.extend
        if e:
            start, n = start + e, n - 2 * e
        scales = tuple(self.scale_of(a) if is_var(a) else 1 for a in eqn.invars)
        return extended_partial(sink.reducer, eqn, invals, sink.ins, scales, start, n, e)


class Extending:
    """Growing a region on extended chunks (a ``memsafe.split.span.Spanning``, tried first by the
    planner where the program has windowed operations): the split rules are told
    ``RuleContext.extended``, equations join only where they run unchanged on an extended chunk
    (:func:`runs_extended`) with lengths their mapping agrees with, and the region runs on an
    :class:`Extended` span (its axis the values' greatest common length, :func:`scales`; its
    extension :func:`extension`), or the plain one where nothing extends."""

    mixed_lengths: ClassVar[bool] = True

    def applies(self, graph: Graph) -> bool:
        return any(e.primitive.name in WINDOWED for e in graph.eqns)

    def context(self, ctx: registry.RuleContext) -> registry.RuleContext:
        return replace(ctx, extended=True)

    def admit(self, eqn: JaxprEqn, mapping: registry.Mapping) -> None:
        if not runs_extended(eqn, mapping):
            raise registry.NoRule(f"{eqn.primitive.name} does not run on extended chunks (halos)")
        if not lengths_agree(eqn, mapping):
            raise SplitFailure("axis sizes do not match", eqn)

    def span(
        self,
        graph: Graph,
        maps: Mapping[int, Any],
        axis_of: Mapping[Var, int],
        surviving: Sequence[Var],
        size: int,
    ) -> tuple[int, Span]:
        size, scale = scales({v: graph.info(v).shape[ax] for v, ax in axis_of.items()})
        for i, m in maps.items():
            if isinstance(m, Halo) and not m.whole_units(graph.eqns[i], size):
                raise SplitFailure("a chunk of the axis would cut a group", graph.eqns[i])
        extend = extension(graph.eqns, maps, surviving, scale)
        return size, (Extended(extend, scale) if extend or scale else PLAIN_SPAN)


#: Regions on extended chunks (``memsafe.split.planner.SPANS``).
EXTENDED = Extending()
