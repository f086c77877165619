"""The accuracy rule memsafe's results are held to (documented in ``docs/accuracy.md``).

For every output leaf, against jax.jit's result of the same program (compiled with YNNPACK off)
and a float64 reference:

- integer outputs (indices, counts) equal jax.jit's exactly;
- float outputs have NaN exactly where jax.jit has NaN, and ±inf exactly where it has ±inf;
- elsewhere, memsafe's largest error against the float64 reference is at most
  ``FACTOR * max(jit_error, ULPS * eps * magnitude)``, where ``jit_error`` is jax.jit's largest
  error against the same reference, ``eps`` the machine epsilon of the output's dtype and
  ``magnitude`` the largest finite absolute value of the reference.

jax.jit's error on one set of inputs is one draw of its rounding: where terms cancel it can be
far below its usual size by luck, and any other summation order (memsafe's chunks, NumPy's
pairwise sum) then looks many times worse. So ``jit_error`` is the larger of that draw and the
median of :data:`DRAWS` more, each jax.jit's error on the inputs moved by one ulp at random
(:func:`error_scale`), each against the float64 result at its own inputs.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

#: memsafe may be this many times less accurate than jax.jit.
FACTOR = 8.0
#: ... or than this many units of the last place of the output's largest value.
ULPS = 4.0
#: How many one-ulp perturbations of the inputs measure jax.jit's usual error.
DRAWS = 4


def _np(a: Any) -> np.ndarray:
    a = np.asarray(a)
    return a.astype(np.float64) if a.dtype.kind == "f" or a.dtype.name == "bfloat16" else a


def _is_float(a: Any) -> bool:
    return np.asarray(a).dtype.kind == "f" or np.asarray(a).dtype.name == "bfloat16"


def _eps(a: Any) -> float:
    return float(jax.numpy.finfo(np.asarray(a).dtype).eps)


def check_leaf(ms: Any, jit: Any, ref: Any, jit_error: float | None = None) -> str | None:
    """Compare one output; returns None when memsafe's ``ms`` obeys the rule against jax.jit's
    ``jit`` and the float64 reference ``ref``, else a sentence saying how it does not.

    ``jit_error`` overrides jax.jit's error (used for float64 programs, whose reference is
    jax.jit's own result: the error is estimated from the float32 program)."""
    a, b = _np(ms), _np(jit)
    if a.shape != b.shape:
        return f"shape {a.shape} != jax.jit's {b.shape}"
    if not _is_float(jit):
        bad = np.flatnonzero(a.reshape(-1) != b.reshape(-1))
        if bad.size:
            i = int(bad[0])
            return (
                f"{bad.size} of {a.size} integer values differ from jax.jit's "
                f"(first at flat {i}: {a.reshape(-1)[i]} vs {b.reshape(-1)[i]})"
            )
        return None
    for name, mask in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        ma, mb = mask(a), mask(b)
        if (ma != mb).any():
            return (
                f"{name} at {int(ma.sum())} positions, jax.jit at {int(mb.sum())} "
                f"({int((ma != mb).sum())} differ)"
            )
    r = _np(ref)
    ok = np.isfinite(a) & np.isfinite(b) & np.isfinite(r)
    if not ok.any():
        return None
    magnitude = float(np.abs(r[ok]).max())
    err_ms = float(np.abs(a[ok] - r[ok]).max())
    err_jit = float(np.abs(b[ok] - r[ok]).max()) if jit_error is None else jit_error
    bound = FACTOR * max(err_jit, ULPS * _eps(jit) * magnitude)
    if err_ms > bound:
        return (
            f"error {err_ms:.3g} against float64 exceeds {FACTOR:g} x max(jax.jit's {err_jit:.3g},"
            f" {ULPS:g} ulp x {magnitude:.3g})"
        )
    return None


def max_error(out: Any, ref: Any) -> list[float]:
    """Per float leaf, the largest error of ``out`` against ``ref`` where both are finite."""
    errors = []
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        if not _is_float(o):
            errors.append(0.0)
            continue
        a, b = _np(o), _np(r)
        ok = np.isfinite(a) & np.isfinite(b)
        errors.append(float(np.abs(a[ok] - b[ok]).max()) if ok.any() else 0.0)
    return errors


def error_scale(first: list[float], draws: list[list[float]]) -> list[float]:
    """Per leaf, jax.jit's error scale: the larger of its error on the inputs (``first``) and the
    median of its errors on perturbed inputs (``draws``, one list per draw)."""
    if not draws:
        return list(first)
    return [max(e, float(np.median(d))) for e, d in zip(first, zip(*draws))]


def identical(ms: Any, jit: Any) -> bool:
    """Whether memsafe's outputs have exactly jax.jit's structure, shapes, dtypes and values
    (NaN where it has NaN; signed zeros compare equal): then :func:`check` passes against any
    reference (memsafe's error is jax.jit's), and the harness need not compute one."""
    ms_l, jit_l = jax.tree.leaves(ms), jax.tree.leaves(jit)
    if jax.tree.structure(ms) != jax.tree.structure(jit) or len(ms_l) != len(jit_l):
        return False
    for a, b in zip(ms_l, jit_l):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if not np.array_equal(a, b, equal_nan=_is_float(a)):
            return False
    return True


def check(ms: Any, jit: Any, ref: Any, jit_errors: list[float] | None = None) -> list[str]:
    """Apply :func:`check_leaf` to every leaf of the outputs; returns the violations, each
    prefixed by the leaf's position (empty when memsafe obeys the rule)."""
    ms_l, jit_l, ref_l = jax.tree.leaves(ms), jax.tree.leaves(jit), jax.tree.leaves(ref)
    if len(ms_l) != len(jit_l):
        return [f"{len(ms_l)} outputs, jax.jit gives {len(jit_l)}"]
    problems = []
    for i, (a, b, r) in enumerate(zip(ms_l, jit_l, ref_l)):
        override = None if jit_errors is None else jit_errors[i]
        why = check_leaf(a, b, r, override)
        if why:
            problems.append(f"output {i}: {why}")
    return problems
