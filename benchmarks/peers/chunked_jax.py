"""Hand-chunked JAX, the best a user would write by hand without memsafe.

kNN: the expanded distance as a GEMM per chunk, over the database axis (a scan with a running
top-k merge) or over the query axis (``lax.map(batch_size=...)``). Kernel products:
``lax.map(batch_size=...)`` over rows. Each is jitted with XLA's YNNPACK fusions on or off
(``ynn``), since which is faster depends on the program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

YNN_OFF = {"xla_cpu_experimental_ynn_fusion_type": ""}


def jit(fun: Callable, ynn: bool, **kwargs) -> Callable:
    """``jax.jit`` with YNNPACK fusions on (JAX's default on the CPU) or off."""
    if not ynn and jax.default_backend() == "cpu":
        kwargs["compiler_options"] = YNN_OFF
    return jax.jit(fun, **kwargs)


def _distances(q: jax.Array, y: jax.Array, metric: str) -> jax.Array:
    """Distances of a block of queries to a block of points, in the cheapest form per metric."""
    if metric in ("l2", "l2_expanded"):
        return jnp.maximum((q * q).sum(1)[:, None] + (y * y).sum(1)[None] - 2 * q @ y.T, 0)
    if metric == "l1":
        return jnp.sum(jnp.abs(q[:, None, :] - y[None, :, :]), axis=-1)
    if metric == "cosine":
        qn = q / jnp.linalg.norm(q, axis=1, keepdims=True)
        yn = y / jnp.linalg.norm(y, axis=1, keepdims=True)
        return 1.0 - qn @ yn.T
    raise ValueError(f"unknown metric {metric!r}")


def knn_over_database(
    x: jax.Array, y: jax.Array, k: int, metric: str = "l2", chunk: int = 4096
) -> tuple[jax.Array, jax.Array]:
    """Scan over database chunks, merging each chunk's top-k into a running top-k."""
    m, d = y.shape
    n_chunks = -(-m // chunk)
    pad = n_chunks * chunk - m
    # Padded rows get an infinite distance through a mask, so they are never selected.
    y_pad = jnp.concatenate([y, jnp.zeros((pad, d), y.dtype)]).reshape(n_chunks, chunk, d)
    n = x.shape[0]
    init = (jnp.full((n, k), jnp.inf, x.dtype), jnp.zeros((n, k), jnp.int32))

    def step(carry, inputs):
        best_d, best_i = carry
        i, yc = inputs
        dist = _distances(x, yc, metric)
        cols = i * chunk + jnp.arange(chunk, dtype=jnp.int32)
        dist = jnp.where(cols[None, :] < m, dist, jnp.inf)
        neg, idx = lax.top_k(-dist, k)
        all_d = jnp.concatenate([best_d, -neg], axis=1)
        all_i = jnp.concatenate([best_i, cols[idx]], axis=1)
        neg2, pos = lax.top_k(-all_d, k)
        return (-neg2, jnp.take_along_axis(all_i, pos, axis=1)), None

    (dist, idx), _ = lax.scan(step, init, (jnp.arange(n_chunks, dtype=jnp.int32), y_pad))
    return dist, idx


def knn_over_queries(
    x: jax.Array, y: jax.Array, k: int, metric: str = "l2", batch: int = 64
) -> tuple[jax.Array, jax.Array]:
    """``lax.map`` over queries in batches: each batch sees the whole database."""

    def one(q):
        neg, idx = lax.top_k(-_distances(q[None], y, metric)[0], k)
        return -neg, idx

    return lax.map(one, x, batch_size=batch)


def gaussian_kernel_matvec(
    x: jax.Array, y: jax.Array, v: jax.Array, lengthscale: float, batch: int = 256
) -> jax.Array:
    """``lax.map`` over rows of x in batches of ``batch``: one kernel row block at a time."""

    def row(xi):
        sq = jnp.sum((xi[None, :] - y) ** 2, axis=-1)
        return jnp.exp(-sq / (2 * lengthscale**2)) @ v

    return lax.map(row, x, batch_size=batch)


def make_knn(kind: str, metric: str, k: int, ynn: bool, chunk: int) -> Callable:
    """A jitted hand-chunked kNN: ``kind`` is 'database' or 'queries'."""
    if kind == "database":
        fun = functools.partial(knn_over_database, k=k, metric=metric, chunk=chunk)
    elif kind == "queries":
        fun = functools.partial(knn_over_queries, k=k, metric=metric, batch=chunk)
    else:
        raise ValueError(f"unknown chunking {kind!r}; expected 'database' or 'queries'")
    return jit(fun, ynn)


def sinkhorn(
    x: jax.Array, y: jax.Array, eps: float, steps: int, batch: int = 256
) -> tuple[jax.Array, jax.Array]:
    """Log-domain Sinkhorn with each half-step a ``lax.map`` over rows in batches of ``batch``:
    the cost of a row block against every point, made and reduced at once (never stored)."""
    n, m = x.shape[0], y.shape[0]
    log_a, log_b = -jnp.log(n) * jnp.ones(n), -jnp.log(m) * jnp.ones(m)

    def half(pot: jax.Array, a: jax.Array, b: jax.Array, log_w: jax.Array) -> jax.Array:
        def row(ai):
            c = jnp.sum((ai[None, :] - b) ** 2, axis=-1)
            return -eps * jax.nn.logsumexp((pot - c) / eps + log_w)

        return lax.map(row, a, batch_size=batch)

    def step(i, fg):
        f = half(fg[1], x, y, log_b)
        return f, half(f, y, x, log_a)

    return lax.fori_loop(0, steps, step, (jnp.zeros(n), jnp.zeros(m)))
