"""Gaussian-kernel matrix-vector product, written as ``exp(-sqdist / (2 l^2)) @ v``.

The kernel matrix is n x m: at n = m = 100,000 it is 37 GiB in float32, although the answer is
a vector of n numbers. This is the product KeOps was built for; memsafe.jit must get there from
the obvious code.

Run as a script: ``python -m examples.kernel_matvec --n 20000 --m 20000 --d 3 --limit 64MiB``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def gaussian_kernel_matvec(
    x: jax.Array, y: jax.Array, v: jax.Array, lengthscale: float | jax.Array = 1.0
) -> jax.Array:
    """``K @ v`` with ``K[i, j] = exp(-|x_i - y_j|^2 / (2 l^2))``; x (n, d), y (m, d), v (m,)
    or (m, p)."""
    sqdist = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    return jnp.exp(-sqdist / (2 * lengthscale**2)) @ v


def make_inputs(
    n: int, m: int, d: int, p: int | None = None, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Points uniform in the unit cube (scaled so that kernel values spread over (0, 1]) and a
    standard normal ``v`` of shape (m,) or (m, p)."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (n, d)).astype(np.float32)
    y = rng.uniform(0, 1, (m, d)).astype(np.float32)
    v = rng.standard_normal((m,) if p is None else (m, p)).astype(np.float32)
    return x, y, v


def reference(
    x: np.ndarray,
    y: np.ndarray,
    v: np.ndarray,
    lengthscale: float = 1.0,
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """Exact float64 ``K @ v`` for the rows ``rows`` of x (NumPy, in row blocks)."""
    xs = np.asarray(x if rows is None else x[rows], np.float64)
    y64, v64 = np.asarray(y, np.float64), np.asarray(v, np.float64)
    out = np.empty((xs.shape[0], *v64.shape[1:]))
    step = max(1, 2**23 // max(1, y64.shape[0]))
    for s in range(0, xs.shape[0], step):
        q = xs[s : s + step]
        d2 = ((q[:, None, :] - y64[None]) ** 2).sum(-1)
        out[s : s + step] = np.exp(-d2 / (2 * lengthscale**2)) @ v64
    return out


def relative_error(got: np.ndarray, ref: np.ndarray) -> float:
    """max |got - ref| / max |ref|: the error relative to the scale of the answer."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - ref)) / np.max(np.abs(ref)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--m", type=int, default=20_000)
    parser.add_argument("--d", type=int, default=3)
    parser.add_argument("--lengthscale", type=float, default=0.5)
    parser.add_argument("--limit", default="64MiB", help="memsafe memory limit")
    args = parser.parse_args()

    import memsafe

    x, y, v = make_inputs(args.n, args.m, args.d)
    safe = memsafe.jit(gaussian_kernel_matvec, memory_limit=args.limit)
    print(safe.plan(x, y, v, args.lengthscale))
    start = time.perf_counter()
    out = jax.block_until_ready(safe(x, y, v, args.lengthscale))
    print(f"memsafe.jit: {time.perf_counter() - start:.2f} s")
    rows = np.arange(min(100, args.n))
    print(
        "relative error:",
        relative_error(np.asarray(out)[rows], reference(x, y, v, args.lengthscale, rows)),
    )


if __name__ == "__main__":
    main()
