"""k-nearest neighbours, written the obvious way: pairwise distances by broadcasting, then top-k.

Every function takes queries ``x`` (n, d) and a database ``y`` (m, d) and returns
``(distances, indices)``, both (n, k), nearest first. ``k`` is a Python int (static under jit).
Written as a user writes them: for n=10,000 and m=1,000,000 the n x m distance matrix alone is
40 GB, which is what memsafe.jit has to avoid.

Run as a script: ``python -m examples.knn --n 2000 --m 100000 --d 64 --k 10 --metric l2
--limit 256MiB``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

METRICS = ("l2", "l2_expanded", "l1", "cosine")


def knn_l2(x: jax.Array, y: jax.Array, k: int = 10) -> tuple[jax.Array, jax.Array]:
    """Squared-L2 kNN in the broadcast form: an (n, m, d) difference reduced over d."""
    d2 = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    neg, idx = lax.top_k(-d2, k)
    return -neg, idx


def knn_l2_expanded(x: jax.Array, y: jax.Array, k: int = 10) -> tuple[jax.Array, jax.Array]:
    """Squared-L2 kNN in the expanded form |x|^2 + |y|^2 - 2 x y^T (a GEMM, then top-k)."""
    d2 = (x * x).sum(1)[:, None] + (y * y).sum(1)[None] - 2 * x @ y.T
    neg, idx = lax.top_k(-d2, k)
    return -neg, idx


def knn_l1(x: jax.Array, y: jax.Array, k: int = 10) -> tuple[jax.Array, jax.Array]:
    """L1 (Manhattan) kNN: no GEMM form exists, the (n, m, d) reduction is the algorithm."""
    d1 = jnp.sum(jnp.abs(x[:, None, :] - y[None, :, :]), axis=-1)
    neg, idx = lax.top_k(-d1, k)
    return -neg, idx


def knn_cosine(x: jax.Array, y: jax.Array, k: int = 10) -> tuple[jax.Array, jax.Array]:
    """Cosine-distance kNN (1 - cos angle), by broadcasting the products and reducing over d."""
    dots = jnp.sum(x[:, None, :] * y[None, :, :], axis=-1)
    norms = jnp.linalg.norm(x, axis=1)[:, None] * jnp.linalg.norm(y, axis=1)[None, :]
    dist = 1.0 - dots / norms
    neg, idx = lax.top_k(-dist, k)
    return -neg, idx


FUNCTIONS = {
    "l2": knn_l2,
    "l2_expanded": knn_l2_expanded,
    "l1": knn_l1,
    "cosine": knn_cosine,
}


def make_inputs(
    n: int, m: int, d: int, seed: int = 0, dtype: type = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """Queries and database drawn from a standard normal with a fixed NumPy seed."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d), dtype=np.float32).astype(dtype)
    y = rng.standard_normal((m, d), dtype=np.float32).astype(dtype)
    return x, y


def reference_distances(
    x: np.ndarray, y: np.ndarray, metric: str, rows: np.ndarray | None = None
) -> np.ndarray:
    """Exact float64 distances of the queries ``x[rows]`` to all of ``y`` (NumPy, row blocks)."""
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {METRICS}")
    xs = np.asarray(x if rows is None else x[rows], np.float64)
    y64 = np.asarray(y, np.float64)
    out = np.empty((xs.shape[0], y64.shape[0]))
    step = max(1, 2**24 // max(1, y64.shape[0] * (y64.shape[1] if metric == "l1" else 1)))
    for s in range(0, xs.shape[0], step):
        q = xs[s : s + step]
        if metric in ("l2", "l2_expanded"):
            out[s : s + step] = (
                (q * q).sum(1)[:, None] + (y64 * y64).sum(1)[None] - 2 * q @ y64.T
            ).clip(0)
        elif metric == "l1":
            out[s : s + step] = np.abs(q[:, None, :] - y64[None]).sum(-1)
        else:
            qn = q / np.linalg.norm(q, axis=1, keepdims=True)
            yn = y64 / np.linalg.norm(y64, axis=1, keepdims=True)
            out[s : s + step] = 1.0 - qn @ yn.T
    return out


def neighbour_errors(
    x: np.ndarray,
    y: np.ndarray,
    metric: str,
    distances: np.ndarray,
    indices: np.ndarray,
    rows: np.ndarray,
) -> dict[str, float]:
    """Accuracy of a kNN answer on the sampled query ``rows`` against exact float64 distances.

    ``recall``: the fraction of returned neighbours whose exact distance is within the k-th exact
    distance (plus a float32 tolerance), so ties do not count as misses; ``max_abs_distance_error``:
    the largest error of the returned distances against the exact distances of the same indices.
    """
    k = indices.shape[1]
    exact = reference_distances(x, y, metric, rows)
    kth = np.partition(exact, k - 1, axis=1)[:, k - 1]
    got = np.take_along_axis(exact, np.asarray(indices[rows], np.int64), axis=1)
    scale = np.abs(exact).max(axis=1, keepdims=True) + 1.0
    tol = 1e-5 * scale
    recall = float(np.mean(got <= kth[:, None] + tol))
    dist_err = float(np.max(np.abs(np.asarray(distances[rows], np.float64) - got)))
    return {"recall": recall, "max_abs_distance_error": dist_err}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000, help="queries")
    parser.add_argument("--m", type=int, default=100_000, help="database points")
    parser.add_argument("--d", type=int, default=64, help="dimension")
    parser.add_argument("--k", type=int, default=10, help="neighbours")
    parser.add_argument("--metric", choices=METRICS, default="l2")
    parser.add_argument("--limit", default="256MiB", help="memsafe memory limit")
    args = parser.parse_args()

    import memsafe

    x, y = make_inputs(args.n, args.m, args.d)
    fun = FUNCTIONS[args.metric]
    safe = memsafe.jit(fun, memory_limit=args.limit, static_argnames="k")
    plan = safe.plan(x, y, k=args.k)
    print(plan)
    start = time.perf_counter()
    dist, idx = jax.block_until_ready(safe(x, y, k=args.k))
    print(f"memsafe.jit: {time.perf_counter() - start:.2f} s")
    rows = np.arange(min(50, args.n))
    print(neighbour_errors(x, y, args.metric, np.asarray(dist), np.asarray(idx), rows))


if __name__ == "__main__":
    main()
