"""The pairwise squared distance ``sum((x_i - y_j)^2)`` as one GEMM, with jax.jit's answer.

Expanded naively, ``|x_i|^2 + |y_j|^2 - 2 x_i.y_j`` loses what the direct form keeps:

* **Precision.** The expansion cancels: its error is about ``eps * (|x_i|^2 + |y_j|^2)``, so
  points far from the origin (or near each other) lose every digit. Here both sets are shifted by a
  common centre (a median of ``x``'s finite values) first, which leaves distances unchanged.
* **Range.** Squares of huge coordinates overflow where their differences do not. Both sets are
  scaled by a power of two (exact) so that no square of ``x``'s frame can overflow, and the result
  scaled back. The frame is computed from ``x`` alone: a program split along ``y``'s rows then
  needs nothing of ``y`` whole.
* **Non-finite inputs.** ``inf - inf`` made NaN of an infinite distance. Pairs whose rows are not
  all finite get jax.jit's value: NaN where either row holds a NaN or both hold an infinity of
  the same sign at the same coordinate, else ``+inf``. A row's NaN or infinity rides on its
  squared norm, so the pair's sum carries it; the coincidences are found by the same GEMM:
  non-finite rows are encoded (see :func:`_operands`) so that its entry is NaN exactly where the
  direct form's difference is ``inf - inf``; and one select per pair gives ``+inf`` to a finite
  row against an infinite one, whose GEMM entry may be NaN (``inf * 0``).
* **Gradients.** The derivative of the expansion, clamp included, is not the derivative of the
  direct form; a custom VJP gives the exact one, ``d/dx_i = 2 sum_j g_ij (x_i - y_j)``, as
  ``2 (x_i sum_j g_ij - g y)`` on the centred data (two GEMMs, no n*m*d value), with the NaN and
  infinity jax.jit's gradient would give for non-finite inputs.

Known limits: two points that both lie farther from the centre than the square root of the
dtype's largest value (about 1.8e19 in float32), yet near each other, get the expansion's error
on that scale (jax.jit's distance between them is finite and small); values of ``x`` near the
dtype's largest (3e38 in float32) scale the frame down so far that the squares of ordinary
distances underflow (0 where jax.jit gives 5.25); the gradient of a nearly coincident pair far
from the centre on its own scale (1e-3) can miss the accuracy rule (error 2e-11 against an
allowed 3.4e-12; one in 600 property draws); and a cotangent that is infinite where the points
differ gives NaN where jax.jit gives an infinity.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memsafe import policy

_HIGHEST = lax.Precision.HIGHEST


class Frame(NamedTuple):
    """A common coordinate frame for ``x`` and ``y``: ``v -> v * scale - centre``.

    ``scale`` is a power of two (exact) and ``unscale`` its inverse; ``centre`` has one entry per
    feature, already multiplied by ``scale``."""

    scale: jnp.ndarray
    unscale: jnp.ndarray
    centre: jnp.ndarray

    def place(self, v: jnp.ndarray) -> jnp.ndarray:
        """Rows of ``v`` in this frame."""
        return v * self.scale - self.centre


def _largest_safe_exponent(dtype: np.dtype, depth: int) -> int:
    """``b`` such that ``depth`` squares of differences of values up to ``2**b`` cannot overflow
    (nor their sum, nor twice a dot product of such rows)."""
    max_exp = int(jnp.finfo(dtype).maxexp)  # finfo.max < 2**maxexp
    return (max_exp - 4 - int(np.ceil(np.log2(max(depth, 1))))) // 2


def _scale(x: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    """(scale, unscale): powers of two bringing the largest finite value of ``x`` under the size
    whose squares cannot overflow (1 when it already is)."""
    largest = jnp.max(jnp.where(jnp.isfinite(x), jnp.abs(x), 0), initial=0)
    _, exponent = jnp.frexp(largest)  # largest < 2**exponent
    shift = jnp.maximum(exponent - _largest_safe_exponent(x.dtype, x.shape[-1]), 0)
    one = jnp.ones((), x.dtype)
    return jnp.ldexp(one, -shift), jnp.ldexp(one, shift)


def _centre(xs: jnp.ndarray, ordinary: jnp.ndarray) -> jnp.ndarray:
    """The coordinate-wise median of a strided sample of rows of ``xs``: of its ``ordinary``
    values (finite, with squares that cannot overflow unscaled), or of its finite values in a
    column with none. In the bulk of the data, which far outliers (huge values) cannot drag away
    as they drag a mean, nor, being skipped, as they drag the median of a few rows (2 rows, one
    of them at 1e20: the midpoint left the other row 5e19 from the centre, and its distances lost
    every digit). Costs O(d) memory and O(s log s) per feature, s the
    sample (``policy.REWRITE.centre_sample``)."""
    step = max(1, -(-xs.shape[0] // policy.REWRITE.centre_sample))
    rows, ordinary = xs[::step], ordinary[::step]
    if rows.shape[0] == 0:
        return jnp.zeros(xs.shape[1:], xs.dtype)
    wide = rows.astype(jnp.promote_types(xs.dtype, jnp.float32))
    bulk = jnp.nanmedian(jnp.where(ordinary, wide, jnp.nan), axis=0)
    finite = jnp.nanmedian(jnp.where(jnp.isfinite(wide), wide, jnp.nan), axis=0)
    centre = jnp.where(jnp.isnan(bulk), finite, bulk)
    return jnp.where(jnp.isnan(centre), 0, centre).astype(xs.dtype)


def frame(x: jnp.ndarray) -> Frame:
    """The frame in which rows of ``x`` (n, d) and of another set are expanded: scaled by a power
    of two when the largest finite value of ``x`` could overflow, centred on a median of its
    finite values (of those that could not, where there are some). Computed from ``x`` alone, so
    that a program split along the other set's rows needs nothing of that set whole."""
    scale, unscale = _scale(x)
    bound = 2.0 ** _largest_safe_exponent(x.dtype, x.shape[-1])
    return Frame(scale, unscale, _centre(x * scale, jnp.abs(x) < bound))


class _Rows(NamedTuple):
    """Per-row facts of one side: finite rows, and a code for the pairs (finite 0, infinite 1,
    NaN ``nan_code``: a pair's codes add up to 1 exactly where one row is finite and the other
    infinite). The code is one reduction over the row, so the per-pair epilogue reads it as it
    is, with nothing left for XLA's fusion to recompute per pair."""

    finite: jnp.ndarray
    code: jnp.ndarray

    @classmethod
    def of(cls, v: jnp.ndarray, nan_code: int) -> _Rows:
        each = jnp.where(jnp.isnan(v), nan_code, jnp.where(jnp.isinf(v), 1, 0))
        code = jnp.max(each.astype(jnp.int32), axis=-1)
        return cls(code == 0, code)


def _operands(
    x: jnp.ndarray,
    y: jnp.ndarray,
    rx: _Rows,
    ry: _Rows,
    placed_x: jnp.ndarray,
    placed_y: jnp.ndarray,
) -> tuple:
    """The GEMM's operands: finite rows as placed in the frame (``placed_y`` has a row of ``y``
    whose squared norm overflows the frame at zero); rows with a non-finite value encoded so
    that ``x~_i . y~_j`` of two such rows is NaN exactly where ``x_i - y_j`` has ``inf - inf``
    (x: +inf -> inf, -inf -> 0, else 1; y: +inf -> 0, -inf -> -inf, else -1: a same-signed pair
    of infinities gives ``inf * 0``, every other product is 0, -1 or -inf, and a sum of those is
    never NaN nor +inf)."""
    inf = jnp.asarray(jnp.inf, x.dtype)
    enc_x = jnp.where(x == inf, inf, jnp.where(x == -inf, 0, 1)).astype(x.dtype)
    enc_y = jnp.where(y == inf, 0, jnp.where(y == -inf, -inf, -1)).astype(y.dtype)
    xt = jnp.where(rx.finite[:, None], placed_x, enc_x)
    yt = jnp.where(ry.finite[:, None], placed_y, enc_y)
    return xt, yt


def gram(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """x @ y.T at full precision (no TF32 on GPUs: the expansion cancels)."""
    return lax.dot_general(x, y, (((1,), (1,)), ((), ())), precision=_HIGHEST)


def _forward(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """``max(|x_i|^2 + |y_j|^2 - 2 x_i.y_j, 0)`` in the frame, scaled back, where each row's
    non-finite values ride on its squared norm (a NaN gives NaN, an infinity +inf: the sum of
    squares carries them as it is) and one select per pair covers the pairs the GEMM cannot: a
    finite row against an infinite one (+inf; their product may be NaN). Two infinite rows give
    NaN through the GEMM exactly where they share an infinity.

    The norms and codes are reductions, not selects over them: XLA fuses the per-pair epilogue
    into the top-k's blocks and would recompute a select of a row's facts for every pair."""
    fr = frame(x)
    rx, ry = _Rows.of(x, nan_code=10), _Rows.of(y, nan_code=20)
    placed_x, placed_y = fr.place(x), fr.place(y)
    xx = jnp.sum(placed_x * placed_x, -1)
    yy = jnp.sum(placed_y * placed_y, -1)
    too_large = ry.finite & jnp.isinf(yy)  # farther from every x than overflow allows
    placed_y = jnp.where(too_large[:, None], 0, placed_y)
    xt, yt = _operands(x, y, rx, ry, placed_x, placed_y)
    g = gram(xt, yt)
    d2 = jnp.maximum(xx[:, None] + yy[None, :] - 2 * g, 0) * fr.unscale * fr.unscale
    mixed = rx.code[:, None] + ry.code[None, :] == 1
    # abs: a NaN of the arithmetic may come out with its sign bit set (x86's default NaN), as
    # may a NaN input's; top_k ranks those apart from the direct form's NaN
    return jnp.abs(jnp.where(mixed, jnp.asarray(jnp.inf, d2.dtype), d2))


def _grad_rows(a: jnp.ndarray, b: jnp.ndarray, g: jnp.ndarray, fr: Frame) -> jnp.ndarray:
    """``2 sum_j g_ij (a_i - b_j)`` (the cotangent of ``a`` (n, d) given ``g`` (n, m)), with the
    NaN and infinities that sum has: infinite coordinates of ``b`` stay in the GEMM (where they
    give ``g_ij * inf`` as the direct form does); those of ``a`` and NaNs are set from flags."""
    at, bt = fr.place(a), fr.place(b)
    a0 = jnp.where(jnp.isfinite(a), at, 0)
    b0 = jnp.where(jnp.isnan(bt), 0, bt)
    rows = jnp.sum(g, axis=1, keepdims=True)
    prod = lax.dot_general(g, b0, (((1,), (0,)), ((), ())), precision=_HIGHEST)
    out = 2 * (a0 * rows - prod) * fr.unscale  # d/da of unscale^2 D(a * scale)
    # Where a_ik is infinite every term is g_ij * a_ik: NaN for a zero or NaN g_ij, else its sign.
    pos = jnp.any(g > 0, axis=1, keepdims=True)
    neg = jnp.any(g < 0, axis=1, keepdims=True)
    zero = jnp.any((g == 0) | jnp.isnan(g), axis=1, keepdims=True)
    sign = jnp.sign(a)
    at_inf = jnp.where(pos, sign * jnp.inf, jnp.where(neg, -sign * jnp.inf, 0)).astype(out.dtype)
    same_inf = jnp.any(b == jnp.inf, 0) & (a == jnp.inf) | jnp.any(b == -jnp.inf, 0) & (
        a == -jnp.inf
    )
    nan_at_inf = zero | (pos & neg) | same_inf
    out = jnp.where(jnp.isinf(a), jnp.where(nan_at_inf, jnp.nan, at_inf), out)
    return jnp.where(jnp.isnan(a) | jnp.any(jnp.isnan(b), 0), jnp.nan, out)


@jax.custom_vjp
def sqdist(x: jnp.ndarray, y: jnp.ndarray) -> jnp.ndarray:
    """``sum((x[:, None] - y[None]) ** 2, -1)`` for ``x`` (n, d) and ``y`` (m, d), computed with
    one GEMM in a centred, scaled frame; NaN and infinities as the direct form gives them.

    Returns:
        The (n, m) squared distances, never negative.
    """
    return _forward(x, y)


def _sqdist_fwd(x: jnp.ndarray, y: jnp.ndarray) -> tuple[jnp.ndarray, tuple]:
    return _forward(x, y), (x, y)


def _sqdist_bwd(res: tuple, g: jnp.ndarray) -> tuple[jnp.ndarray, jnp.ndarray]:
    x, y = res
    fr = frame(x)
    return _grad_rows(x, y, g, fr), _grad_rows(y, x, g.T, fr)


sqdist.defvjp(_sqdist_fwd, _sqdist_bwd)
