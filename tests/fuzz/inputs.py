"""Arguments of a case: ``x``, ``y``, ``v`` (floats) and ``labels`` (int32), drawn from its seed."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .program import BATCHED_WRAPPERS, Case, v_rows


@dataclass(frozen=True)
class Inputs:
    """The arguments in the program's dtype (``args``; each an array or, in deep programs, a
    pytree of arrays) and a note of injected non-finite values."""

    args: tuple[jnp.ndarray, ...]
    note: str

    def perturbed(self, seed: int, args: tuple[jnp.ndarray, ...] | None = None) -> tuple:
        """``args`` (default: these arguments) with every finite non-zero float moved one unit in
        the last place, up or down at random (NaN, inf, zeros and integers unchanged): inputs as
        good as these, on which jax.jit's rounding error is another draw of the same size."""
        rng = np.random.default_rng(seed)

        def move(a: jnp.ndarray) -> jnp.ndarray:
            if not jnp.issubdtype(a.dtype, jnp.floating):
                return a
            up = rng.random(a.shape) < 0.5
            return jnp.asarray(next_after(np.asarray(a), up))

        return tuple(jax.tree.map(move, a) for a in (self.args if args is None else args))

    def cast(self, dtype: str, args: tuple[jnp.ndarray, ...] | None = None) -> tuple:
        """``args`` (default: these arguments) with the float arguments cast to ``dtype`` (exact
        when widening)."""

        def widen(a: jnp.ndarray) -> jnp.ndarray:
            if not jnp.issubdtype(a.dtype, jnp.floating):
                return a
            return jnp.asarray(
                np.asarray(a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a), dtype
            )

        return tuple(jax.tree.map(widen, a) for a in (self.args if args is None else args))


def next_after(a: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Each finite non-zero float of ``a`` moved to its neighbour toward +inf where ``up``, else
    toward -inf (``lax.nextafter``'s answer; NaN, inf and zeros unchanged), computed on the host
    on the bits: the neighbour of a non-zero float is its bit pattern plus or minus one, plus one
    when moving away from zero (so any float dtype, bfloat16 included, with no compile per
    shape, as JAX's eager operations would need)."""
    bits = a.view(np.dtype(f"uint{8 * a.dtype.itemsize}"))
    with np.errstate(invalid="ignore"):  # (NaN compares false; it is not moved)
        away = up == (a > 0)  # the move increases the magnitude
    step = np.where(away, 1, -1).astype(bits.dtype)
    moved = (bits + step).view(a.dtype)  # (a wrap-around only where a is 0 or NaN: unused)
    return np.where(np.isfinite(a) & (a != 0), moved, a)


def make_inputs(case: Case) -> Inputs:
    """Draw the arguments of ``case``: standard normal floats, rounded to a half-integer grid for
    ``inputs="ties"`` (many equal values), with a NaN or ±inf placed in ``x`` or ``y`` for
    ``inputs="nan"`` / ``"inf"``; labels uniform in ``[0, m)``."""
    rng = np.random.default_rng(case.seed)
    lead = (case.batch,) if case.wrapper in BATCHED_WRAPPERS else ()
    x = rng.standard_normal((*lead, case.n, case.d))
    y = rng.standard_normal((case.m, case.d))
    v = rng.standard_normal((v_rows(case), case.p))
    labels = rng.integers(0, case.m, (*lead, case.n)).astype(np.int32)
    note = ""
    if case.inputs == "ties":
        x, y, v = (np.round(a * 2) / 2 for a in (x, y, v))
    elif case.inputs in ("nan", "inf"):
        value = np.nan if case.inputs == "nan" else float(rng.choice((np.inf, -np.inf)))
        target = x if rng.random() < 0.5 else y
        flat = target.reshape(-1)
        pos = int(rng.integers(0, flat.size))
        flat[pos] = value
        name = "x" if target is x else "y"
        note = f"{name}.flat[{pos}] = {value}"
    dtype = jnp.dtype(case.dtype)
    args = (
        jnp.asarray(x, dtype),
        jnp.asarray(y, dtype),
        jnp.asarray(v, dtype),
        jnp.asarray(labels),
    )
    return Inputs(args=args, note=note)
