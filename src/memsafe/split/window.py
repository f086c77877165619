"""The geometry of a windowed operation along one axis (a convolution's spatial dimension, a
pooling ``reduce_window``'s): its :class:`Window`, and reading a chunk's windows from the whole
operand by index arithmetic (:meth:`Window.read`, :func:`take`).

A windowed operation computes output position ``o`` along an axis from a window of its operand
after padding and dilation: the *padded* operand holds ``pad_lo`` fill values, then the operand's
positions ``base_dilation`` apart (fill between them), then ``pad_hi`` fill values, and output
``o`` reads padded positions ``o * stride + j * window_dilation`` for ``j < size``. Output chunk
``[a, a + n)`` therefore reads the padded positions ``[a * stride, (n - 1) * stride + (size - 1) *
window_dilation + 1 + a * stride)``: neighbouring chunks' windows overlap. :meth:`Window.read`
takes that range of the whole operand, the padding and dilation filled in, so the operation run on
it without padding or base dilation along the axis gives exactly the chunk's outputs.

The split rules of windowed primitives (``memsafe.split.prims.conv``, ``.pool``) and the halo
strategy (``memsafe.split.strategies.halo``, which runs windowed layers on extended chunks) read
it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax


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


def positions(start: Any, n: int) -> Any:
    """Global positions ``[start, start + n)`` along the axis (int32)."""
    return lax.convert_element_type(start, jnp.int32) + jnp.arange(n, dtype=jnp.int32)


def take(x: Any, axis: int, index: Any, valid: Any, fill: Any) -> Any:
    """``x`` at positions ``index`` along ``axis``, ``fill`` where ``valid`` is false (positions
    outside ``x`` included)."""
    got = jnp.take(x, jnp.clip(index, 0, x.shape[axis] - 1), axis=axis)
    keep = lax.broadcast_in_dim(valid, got.shape, (axis,))
    return lax.select(keep, got, jnp.broadcast_to(jnp.asarray(fill, got.dtype), got.shape))


def reach(lo: int, hi: int, stride: int) -> int:
    """Positions beyond a chunk's own that windows reading ``o * stride - lo`` to ``o * stride
    + hi`` for output ``o`` read, on the farther side."""
    return max(lo, hi - stride + 1, 0)


def aligned(step: int, dilation: int, n_in: int, n_out: int) -> bool:
    """Whether a window that advances ``step`` positions of its operand dilated by ``dilation``
    per result position (one of them 1) runs chunk for chunk: the lengths match them exactly
    (``n_in * dilation == n_out * step``), so a chunk of whole results reads a whole chunk."""
    return min(step, dilation) == 1 and n_in * dilation == n_out * step
