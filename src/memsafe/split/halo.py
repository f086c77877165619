"""Halos: the input positions a chunk of a windowed operation's output reads.

A windowed operation (a convolution, a pooling ``reduce_window``) computes output position ``o``
along an axis from a window of its operand after padding and dilation: the *padded* operand
holds ``pad_lo`` fill values, then the operand's positions ``base_dilation`` apart (fill between
them), then ``pad_hi`` fill values, and output ``o`` reads padded positions
``o * stride + j * window_dilation`` for ``j < size``. Output chunk ``[a, a + n)`` therefore reads
the padded positions ``[a * stride, (n - 1) * stride + (size - 1) * window_dilation + 1 + a *
stride)``: neighbouring chunks' windows overlap (the halo). :meth:`Window.read` takes that range
of the whole operand by index arithmetic, the padding and dilation filled in, so the operation run
on it without padding or base dilation along the axis gives exactly the chunk's outputs.

That reads the operand whole: one layer at a time. Several windowed layers in a row (a stack of 3x3
convolutions over one large image) run in one region on *extended chunks* instead: while the split
rules are told so (``RuleContext.extended``), a windowed operation whose operand is ``stride`` times
as long as its result along the axis (stride 1 with "SAME"-like padding, a 2x2 pooling of an even
axis) maps the axis through (a :class:`~memsafe.split.registry.Halo`), and every region value is
computed over ``[start - E, start + n + E)`` for the chunk ``[start, start + n)``. Each windowed
operation fills the positions of its operand outside the axis with its padding value and runs
unchanged, so its outputs are exact except within its window's reach of the chunk's ends; positional
operations (elementwise, broadcasts, contractions of other axes) keep each position to itself. With
``E`` the most reach any chain of windows adds up to (:func:`extension`), the centre ``[start, start
+ n)`` is exact: sinks and written values take only the centre.

Where strides make values of several lengths, the region's axis is their greatest common divisor
(:func:`scales`): a value ``k`` times as long holds positions ``[k * (start - E), k * (start + n
+ E))`` of its own axis.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, Var

#: Primitives whose split rules map a windowed axis through as a Halo while extending.
WINDOWED = ("conv_general_dilated", "reduce_window_max", "reduce_window_sum", "reduce_window")


@dataclass(frozen=True)
class Window:
    """A windowed operation along one axis.

    Attributes:
        size: window length (kernel size).
        stride: output positions step ``stride`` padded positions.
        pad_lo: fill values before the operand (negative: positions cut off).
        pad_hi: fill values after the operand (negative: positions cut off).
        base_dilation: operand positions sit this far apart in the padded operand (lhs dilation).
        window_dilation: window taps sit this far apart (rhs dilation).
    """

    size: int
    stride: int = 1
    pad_lo: int = 0
    pad_hi: int = 0
    base_dilation: int = 1
    window_dilation: int = 1

    @property
    def trivial(self) -> bool:
        """Whether output position ``o`` reads operand position ``o`` alone (the axis passes)."""
        plain = self.stride == 1 and self.base_dilation == 1
        return self.size == 1 and plain and self.pad_lo == 0 and self.pad_hi == 0

    @property
    def after(self) -> int:
        """Padded positions past ``o * stride`` that output ``o``'s window reads last."""
        return (self.size - 1) * self.window_dilation - self.pad_lo

    @property
    def reach(self) -> int:
        """Padded positions beyond a chunk's own (``[o * stride, (o + 1) * stride)`` for each
        output ``o``) that the window reads, on the farther side."""
        return reach(self.pad_lo, self.after, self.stride)

    def width(self, n: int) -> int:
        """Padded positions ``n`` consecutive outputs read."""
        return (n - 1) * self.stride + (self.size - 1) * self.window_dilation + 1

    def read(self, x: Any, axis: int, start: Any, n: int, fill: Any) -> Any:
        """The padded, dilated positions of ``x`` along ``axis`` that outputs ``[start, start +
        n)`` read, ``fill`` in padding and dilation holes (length :meth:`width`)."""
        first = lax.convert_element_type(start, jnp.int32) * self.stride
        q = first + jnp.arange(self.width(n), dtype=jnp.int32) - self.pad_lo
        d = self.base_dilation
        valid = (q >= 0) & (q % d == 0) & (q // d < x.shape[axis])
        return take(x, axis, q // d, valid, fill)


def take(x: Any, axis: int, index: Any, valid: Any, fill: Any) -> Any:
    """``x`` at positions ``index`` along ``axis``, ``fill`` where ``valid`` is false (positions
    outside ``x`` included)."""
    got = jnp.take(x, jnp.clip(index, 0, x.shape[axis] - 1), axis=axis)
    keep = lax.broadcast_in_dim(valid, got.shape, (axis,))
    return lax.select(keep, got, jnp.broadcast_to(jnp.asarray(fill, got.dtype), got.shape))


def lengths_agree(eqn: JaxprEqn, m: Any) -> bool:
    """Whether the operands and results a mapping splits have lengths along the axis it can run
    chunk for chunk (``Mapping.lengths_agree``)."""
    ins = [a.aval.shape[ax] if ax is not None else None for a, ax in zip(eqn.invars, m.ins)]
    outs = [o.aval.shape[ax] if ax is not None else None for o, ax in zip(eqn.outvars, m.outs)]
    return m.lengths_agree(ins, outs)


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
    value's own positions (``Mapping.wrong_after``: a :class:`~memsafe.split.registry.Halo` adds
    its reach and divides by its stride, other mappings keep the most of their operands'). Sinks
    (plus the reach of a sink that reads a window of an operand, ``Reducer.halo_reach``) and
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
            reach = m.reducer.halo_reach(eqn, m.ins)
            for k, (a, w) in enumerate(zip(eqn.invars, ins)):
                if w is not None:
                    need = max(need, units(w + reach.get(k, 0), a))
            continue
        after = m.wrong_after(ins)
        wrong.update((o, after) for o, ax in zip(eqn.outvars, m.outs) if ax is not None)
    return max([need, *(units(wrong.get(v, 0), v) for v in surviving)])


def reach(lo: int, hi: int, stride: int) -> int:
    """Positions beyond a chunk's own that windows reading ``o * stride - lo`` to ``o * stride
    + hi`` for output ``o`` read, on the farther side."""
    return max(lo, hi - stride + 1, 0)


def aligned(step: int, dilation: int, n_in: int, n_out: int) -> bool:
    """Whether a window that advances ``step`` positions of its operand dilated by ``dilation``
    per result position (one of them 1) runs chunk for chunk: the lengths match them exactly
    (``n_in * dilation == n_out * step``), so a chunk of whole results reads a whole chunk."""
    return min(step, dilation) == 1 and n_in * dilation == n_out * step


def scaled(start: Any, k: int) -> Any:
    """``start * k``, with no equation where ``k`` is 1 (a body that reads no position of the
    axis must not read its start: memsafe.split.selection)."""
    return start if k == 1 else start * k


def positions(start: Any, n: int) -> Any:
    """Global positions ``[start, start + n)`` along the axis (int32)."""
    return lax.convert_element_type(start, jnp.int32) + jnp.arange(n, dtype=jnp.int32)


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
