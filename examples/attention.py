"""Multi-head attention, written the textbook way: scores, softmax, weighted values.

``attention`` takes per-head queries, keys and values (heads, L, d) and materialises the
(heads, L, L) score matrix: at L=32,768 with 8 heads that is 32 GiB in float32, and its backward
pass needs it again. ``multihead_attention`` adds the input and output projections of a
transformer layer. The causal mask uses the most negative finite number, as Flax does.

Run as a script: ``python -m examples.attention --L 4096 --heads 8 --d 64 --causal
--limit 256MiB``.
"""

from __future__ import annotations

import argparse
import math
import time

import jax
import jax.numpy as jnp
import numpy as np


def attention(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = False) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v per head; q (h, Lq, d), k and v (h, Lk, d) -> (h, Lq, d)."""
    scores = jnp.einsum("hqd,hkd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        lq, lk = q.shape[1], k.shape[1]
        mask = jnp.tril(jnp.ones((lq, lk), dtype=bool), k=lk - lq)
        scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    weights = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("hqk,hkd->hqd", weights, v)


def attention_loss(q: jax.Array, k: jax.Array, v: jax.Array, causal: bool = False) -> jax.Array:
    """A scalar of the attention output, to differentiate: the sum of its squares over 2."""
    return 0.5 * jnp.sum(attention(q, k, v, causal) ** 2)


#: Forward and backward in one: the loss and its gradients with respect to q, k and v.
attention_value_and_grad = jax.value_and_grad(attention_loss, argnums=(0, 1, 2))


def init_projections(key: jax.Array, d_model: int, heads: int) -> dict[str, jax.Array]:
    """Query, key, value and output projections of one attention layer."""
    ks = jax.random.split(key, 4)
    scale = 1.0 / math.sqrt(d_model)
    names = ("wq", "wk", "wv", "wo")
    return {n: jax.random.normal(k, (d_model, d_model)) * scale for n, k in zip(names, ks)}


def multihead_attention(
    params: dict[str, jax.Array], x: jax.Array, heads: int, causal: bool = False
) -> jax.Array:
    """Self-attention over a sequence x (L, d_model): project, split heads, attend, merge."""
    seq, d_model = x.shape
    d = d_model // heads

    def split(w: jax.Array) -> jax.Array:
        return (x @ w).reshape(seq, heads, d).transpose(1, 0, 2)

    out = attention(split(params["wq"]), split(params["wk"]), split(params["wv"]), causal)
    return out.transpose(1, 0, 2).reshape(seq, d_model) @ params["wo"]


def make_inputs(
    heads: int, length: int, d: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Standard normal q, k, v of shape (heads, length, d), float32."""
    rng = np.random.default_rng(seed)
    shape = (heads, length, d)
    return tuple(rng.standard_normal(shape, dtype=np.float32) for _ in range(3))  # type: ignore[return-value]


def reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, causal: bool, rows: np.ndarray
) -> np.ndarray:
    """Exact float64 attention output for the query positions ``rows`` (NumPy)."""
    q64 = np.asarray(q[:, rows], np.float64)
    k64, v64 = np.asarray(k, np.float64), np.asarray(v, np.float64)
    s = np.einsum("hqd,hkd->hqk", q64, k64) / math.sqrt(q.shape[-1])
    if causal:
        offset = k.shape[1] - q.shape[1]
        s = np.where(np.arange(k.shape[1])[None, :] <= rows[:, None] + offset, s, -np.inf)
    s = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("hqk,hkd->hqd", s / s.sum(-1, keepdims=True), v64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--L", type=int, default=4096, help="sequence length")
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--d", type=int, default=64, help="head dimension")
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--limit", default="256MiB", help="memsafe memory limit")
    args = parser.parse_args()

    import memsafe

    q, k, v = make_inputs(args.heads, args.L, args.d)
    fwd = memsafe.jit(attention, memory_limit=args.limit, static_argnames="causal")
    start = time.perf_counter()
    out = jax.block_until_ready(fwd(q, k, v, causal=args.causal))
    print(f"forward: {time.perf_counter() - start:.2f} s")
    rows = np.arange(0, args.L, max(1, args.L // 16))
    err = np.abs(np.asarray(out)[:, rows] - reference(q, k, v, args.causal, rows)).max()
    print(f"max abs error on {rows.size} rows: {err:.2e}")
    both = memsafe.jit(attention_value_and_grad, memory_limit=args.limit, static_argnames="causal")
    start = time.perf_counter()
    jax.block_until_ready(both(q, k, v, causal=args.causal))
    print(f"forward + backward: {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
