"""Chunk spans: the positions of each region value that a chunk covers, and how a value's chunk
is read, handed out and reduced.

The split core (:mod:`memsafe.split.region`, :mod:`memsafe.split.loop`,
:mod:`memsafe.split.size`) knows positions only through a region's :class:`Span`. The *plain*
span (:data:`PLAIN_SPAN`) is the chunk itself: chunk ``[start, start + n)`` of the region's axis is
positions ``[start, start + n)`` of every region value. A strategy may grow regions whose chunks
cover more, through a :class:`Spanning` of its own that the planner tries before the plain one
(``memsafe.split.planner.SPANS``): memsafe.split.strategies.halo's extended chunks cover ``E`` more
positions on each side, and let values of several lengths along the axis (a pooling's operand and
result) join one region, each ``k`` positions per position of the axis.

A span is asked for positions in the chunk's *covered* terms: :meth:`Span.cover` turns the chunk's
own ``(start, n)`` into the covered ones, and every other method takes those.
"""

from __future__ import annotations

from collections.abc import Mapping as Mapping_
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, Var
from memsafe.graph import Graph
from memsafe.split.registry import Mapping, RuleContext
from memsafe.split.sinks import Partial, Sink


class Span(Protocol):
    """What the chunks of a grown region cover along its axis.

    Attributes:
        extend: positions beyond its own that a chunk covers on each side (0: none); the size
            model counts them (each chunk holds ``n + 2 * extend`` positions of its values) and
            plans report them.
    """

    extend: int

    @property
    def plain(self) -> bool:
        """Whether a chunk is its own positions of every value, each value as long as the axis
        (what peephole moves, tiled selection, online rescaling and fused kernels assume)."""
        ...

    def scale_of(self, v: Var) -> int:
        """Positions of region value ``v`` along the axis per position of the region's axis."""
        ...

    def scale_for(self, eqn: JaxprEqn, mapping: Mapping) -> int:
        """Positions per position of the region's axis of the chunk ``eqn``'s rule re-binds:
        those of its split results, else of its split operands."""
        ...

    def cover(self, start: Any, n: int) -> tuple[Any, int]:
        """(start, length) of the positions chunk ``[start, start + n)`` covers."""
        ...

    def read(self, value: Any, axis: int, start: Any, n: int, scale: int) -> Any:
        """The covered chunk ``[start, start + n)`` (``scale`` positions of ``value`` per
        position of the axis) of ``value``, a value read from outside the region."""
        ...

    def own(self, value: Any, axis: int, n: int, scale: int) -> Any:
        """The chunk's own positions of ``value``, which holds the covered ``n`` (what is written
        along the axis)."""
        ...

    def partial(self, sink: Sink, eqn: JaxprEqn, invals: list[Any], start: Any, n: int) -> Partial:
        """Sink ``eqn``'s partial result on the chunk from its operands ``invals`` over the
        covered chunk ``[start, start + n)`` (the chunk's own positions only)."""
        ...


class Spanning(Protocol):
    """How a region grows on one kind of :class:`Span`: what the split rules are told, which
    equations may join, and the span the grown region runs on."""

    #: Whether values of several lengths along the axis may join the region (each equation's
    #: mapping then checks its own operands and results, :meth:`admit`); else every value is as
    #: long as the seed's axis.
    mixed_lengths: bool

    def applies(self, graph: Graph) -> bool:
        """Whether regions of ``graph`` may grow on this span at all."""
        ...

    def context(self, ctx: RuleContext) -> RuleContext:
        """What the split rules are told while a region grows on this span, from ``ctx``."""
        ...

    def admit(self, eqn: JaxprEqn, mapping: Mapping) -> None:
        """Raise ``NoRule`` (the axis stops at ``eqn``) or ``SplitFailure`` (the region fails)
        where ``eqn``, mapped as ``mapping``, cannot run on this span."""
        ...

    def span(
        self,
        graph: Graph,
        maps: Mapping_[int, Mapping | Sink],
        axis_of: Mapping_[Var, int],
        surviving: Sequence[Var],
        size: int,
    ) -> tuple[int, Span]:
        """(the region's axis length, its span) once grown: ``maps`` how the axis maps through
        each region equation, ``axis_of`` the axis of every region value, ``surviving`` the
        values written along the axis, ``size`` the seed's length along the axis."""
        ...


def scaled(start: Any, k: int) -> Any:
    """``start * k``, with no equation where ``k`` is 1 (a body that reads no position of the
    axis must not read its start: memsafe.split.strategies.selection)."""
    return start if k == 1 else start * k


def local_start(start: Any, length: int) -> Any:
    """Where the chunk starting at position ``start`` of the axis begins in a value that is
    ``length`` long along it.

    The core's contract for values and their axis: a value as long as the axis holds every
    position, and ``start`` is already inside it (the remainder is ``start``). A value shorter
    than the axis holds one of its equal shares, ``[d * length, (d + 1) * length)`` for some
    ``d``, and a runner that gives such values to a chunk body keeps every chunk within one
    share: the chunk begins at ``start`` modulo ``length``. The core makes no shorter values;
    a runner that splits the axis into shares (``DevicesRunner``) relies on this."""
    return lax.rem(start, jnp.int32(length))


class Plain:
    """The plain span, and its growth: a chunk is its own positions of every value, each as long
    as the axis; every equation the split rules map may join."""

    extend: ClassVar[int] = 0
    plain: ClassVar[bool] = True
    mixed_lengths: ClassVar[bool] = False

    def applies(self, graph: Graph) -> bool:
        return True

    def context(self, ctx: RuleContext) -> RuleContext:
        return ctx

    def admit(self, eqn: JaxprEqn, mapping: Mapping) -> None:
        return None

    def span(
        self,
        graph: Graph,
        maps: Mapping_[int, Mapping | Sink],
        axis_of: Mapping_[Var, int],
        surviving: Sequence[Var],
        size: int,
    ) -> tuple[int, Span]:
        return size, self

    def scale_of(self, v: Var) -> int:
        return 1

    def scale_for(self, eqn: JaxprEqn, mapping: Mapping) -> int:
        return 1

    def cover(self, start: Any, n: int) -> tuple[Any, int]:
        return start, n

    def read(self, value: Any, axis: int, start: Any, n: int, scale: int) -> Any:
        first = local_start(scaled(start, scale), value.shape[axis])
        return lax.dynamic_slice_in_dim(value, first, n * scale, axis)

    def own(self, value: Any, axis: int, n: int, scale: int) -> Any:
        return value

    def partial(self, sink: Sink, eqn: JaxprEqn, invals: list[Any], start: Any, n: int) -> Partial:
        return sink.reducer.partial(eqn, invals, sink.axis, start, n)

    def __repr__(self) -> str:
        return "PLAIN_SPAN"


#: The plain span (and its growth): every region's, unless a strategy's spanning grew it.
PLAIN_SPAN = Plain()
