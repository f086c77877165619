"""Fit closed-over array constants to cheap generators built from iota.

A candidate is ``g(form(convert(B)))`` where ``B`` is an index array of the constant's shape (the
flattened arange reshaped, or an iota along one axis), ``form`` is affine ``a*t + c`` or a power
``a * t**p``, and ``g`` is one of identity, exp, log, sqrt. Parameters are fitted in float64 from a
few elements, snapped to short decimals when that still fits, checked on a random sample, and then
verified against the whole constant with the same float operations the program will run (exact for
integers; ``rtol`` 1e-6 for floats). Only a verified candidate is used.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

#: Relative tolerance for float constants (the issue's contract); integers must match exactly.
RTOL = 1e-6

_UNARY = {
    None: (lambda y: y, lambda t: t, lambda t: t),
    "exp": (np.log, np.exp, jnp.exp),
    "log": (np.exp, np.log, jnp.log),
    "sqrt": (np.square, np.sqrt, jnp.sqrt),
}


@dataclass(frozen=True)
class Candidate:
    """``g(form(B))``: base (-1 flat, k axis k), form ("affine" | "power"), params, unary g."""

    shape: tuple[int, ...]
    dtype: Any
    base: int
    form: str
    a: float
    c: float  # affine offset; for "power" the exponent p
    unary: str | None

    def describe(self) -> str:
        idx = "i" if self.base < 0 else f"i{self.base}"
        body = (
            f"{self.a:g}*{idx}+{self.c:g}"
            if self.form == "affine"
            else f"{self.a:g}*{idx}**{self.c:g}"
        )
        where = "flat index" if self.base < 0 else f"index along axis {self.base}"
        return f"{self.unary}({body})" if self.unary else f"{body} ({where})"

    # -- evaluation ------------------------------------------------------------------------

    def _index_np(self) -> np.ndarray:
        n = int(np.prod(self.shape, dtype=np.int64))
        if self.base < 0:
            return np.arange(n, dtype=np.int64).reshape(self.shape)
        shape = [1] * len(self.shape)
        shape[self.base] = self.shape[self.base]
        return np.broadcast_to(np.arange(self.shape[self.base]).reshape(shape), self.shape)

    def numpy(self) -> np.ndarray:
        """The candidate in NumPy with the program's float type and operation order."""
        return _eval_at(self, self._index_np())

    def jax(self) -> Any:
        """The candidate as traced JAX operations (iota-based; XLA fuses it into consumers)."""
        n = int(np.prod(self.shape, dtype=np.int64))
        index_dtype = jnp.int64 if n >= 2**31 else jnp.int32
        if self.base < 0:
            b = lax.iota(index_dtype, n).reshape(self.shape)
        else:
            b = lax.broadcasted_iota(index_dtype, self.shape, self.base)
        if np.issubdtype(self.dtype, np.integer):
            b = lax.convert_element_type(b, self.dtype)
            return b * np.asarray(int(self.a), self.dtype) + np.asarray(int(self.c), self.dtype)
        t = lax.convert_element_type(b, self.dtype)
        if self.form == "affine":
            if self.a != 1:
                t = t * np.asarray(self.a, self.dtype)
            if self.c != 0:
                t = t + np.asarray(self.c, self.dtype)
        else:
            p = self.c
            if float(p).is_integer() and 0 <= p <= 16:
                t = lax.integer_pow(t, int(p))
            else:
                t = lax.pow(t, np.asarray(p, self.dtype))
            if self.a != 1:
                t = t * np.asarray(self.a, self.dtype)
        return _UNARY[self.unary][2](t)


def _np_pow(t: np.ndarray, p: float, ft: Any) -> np.ndarray:
    if float(p).is_integer() and 0 <= p <= 16:
        out = np.ones_like(t)
        for _ in range(int(p)):
            out = out * t
        return out
    return np.power(t, ft(p))


def _snaps(x: float) -> list[float]:
    """``x`` rounded to 1..8 significant digits (shortest first), then ``x`` itself."""
    if x == 0 or not math.isfinite(x):
        return [x]
    out: list[float] = []
    for digits in range(1, 9):
        r = float(f"{x:.{digits}g}")
        if abs(r - x) <= 2e-7 * abs(x) and r not in out:
            out.append(r)
    if x not in out:
        out.append(x)
    return out


def _close(got: np.ndarray, want: np.ndarray, integer: bool) -> bool:
    if integer:
        return bool(np.array_equal(got, want))
    if not np.all(np.isfinite(got) == np.isfinite(want)):
        return False
    fin = np.isfinite(want)
    g, w = got[fin].astype(np.float64), want[fin].astype(np.float64)
    tiny = 4 * float(np.finfo(want.dtype).tiny)
    return bool(np.all(np.abs(g - w) <= RTOL * np.abs(w) + tiny)) and bool(
        np.array_equal(got[~fin], want[~fin])
    )


def _positions(shape: tuple[int, ...], base: int, values: list[int]) -> list[tuple[int, ...]]:
    """Positions at which the index array ``base`` takes ``values``."""
    out = []
    for v in values:
        if base < 0:
            out.append(tuple(int(i) for i in np.unravel_index(v, shape)))
        else:
            pos = [0] * len(shape)
            pos[base] = v
            out.append(tuple(pos))
    return out


def fit(const: np.ndarray, sample: int = 256, seed: int = 0) -> Candidate | None:
    """The first verified generator for ``const``, or None."""
    const = np.asarray(const)
    shape, dtype = tuple(const.shape), const.dtype
    n = const.size
    integer = np.issubdtype(dtype, np.integer)
    if n < 3 or not (integer or np.issubdtype(dtype, np.floating)):
        return None
    bases = [-1] + [k for k in range(len(shape)) if shape[k] > 2 and len(shape) > 1]
    rng = np.random.default_rng(seed)
    sample_pos = tuple(rng.integers(0, s, size=sample) for s in shape)
    for base in bases:
        extent = n if base < 0 else shape[base]
        pts = _positions(shape, base, [0, 1, 2, extent - 1])
        y64 = np.array([const[p] for p in pts], dtype=np.float64)
        for unary in (None,) if integer else (None, "exp", "log", "sqrt"):
            with np.errstate(all="ignore"):
                y = _UNARY[unary][0](y64)
            if not np.all(np.isfinite(y)):
                continue
            for cand in _forms(shape, dtype, base, unary, y, extent, integer):
                if _verify(cand, const, sample_pos, integer):
                    return cand
    return None


def _forms(
    shape: tuple[int, ...],
    dtype: Any,
    base: int,
    unary: str | None,
    y: np.ndarray,
    extent: int,
    integer: bool,
) -> Iterator[Candidate]:
    """Affine and power candidates fitted from y at index values 0, 1, 2, extent-1."""
    a, c = y[1] - y[0], y[0]
    if integer:
        if float(a).is_integer() and float(c).is_integer():
            yield Candidate(shape, dtype, base, "affine", a, c, None)
        return
    for sa in _snaps(a):
        for sc in _snaps(c):
            yield Candidate(shape, dtype, base, "affine", sa, sc, unary)
    if y[0] == 0 and y[1] != 0 and extent > 3 and y[3] / y[1] > 0:
        amp = y[1]
        p = math.log(y[3] / amp) / math.log(extent - 1)
        for sp in _snaps(p):
            for sa in _snaps(amp):
                yield Candidate(shape, dtype, base, "power", sa, sp, unary)


def _verify(cand: Candidate, const: np.ndarray, sample_pos: tuple, integer: bool) -> bool:
    """A random sample first (cheap), then the whole array."""
    picked = cand._index_np()[sample_pos]
    if not _close(_eval_at(cand, picked), const[sample_pos], integer):
        return False
    return _close(cand.numpy(), const, integer)


def _eval_at(cand: Candidate, index: np.ndarray) -> np.ndarray:
    """The candidate's formula at given index values (same arithmetic as Candidate.numpy)."""
    if np.issubdtype(cand.dtype, np.integer):
        return (index * int(cand.a) + int(cand.c)).astype(cand.dtype)
    ft = np.dtype(cand.dtype).type
    with np.errstate(all="ignore"):
        t = index.astype(cand.dtype)
        if cand.form == "affine":
            t = t * ft(cand.a) if cand.a != 1 else t
            t = t + ft(cand.c) if cand.c != 0 else t
        else:
            t = _np_pow(t, cand.c, ft)
            t = t * ft(cand.a) if cand.a != 1 else t
        return _UNARY[cand.unary][1](t).astype(cand.dtype)
