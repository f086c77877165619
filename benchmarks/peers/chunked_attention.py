"""Memory-efficient attention as Rabe & Staats (2021) describe it, written by hand in JAX.

Queries are processed in chunks (a scan); for each query chunk the keys and values are visited
in chunks (``lax.map``), each returning its un-normalised weighted values, its sum of weights
and its running maximum; the chunks are combined by rescaling to the global maximum. Both chunk
functions are checkpointed, so the backward pass recomputes scores instead of storing them.
Layout: (heads, L, d), like ``examples.attention.attention``.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax


def _key_chunk(q, k, v, q_start, k_start, causal: bool):
    """One (query chunk, key chunk) block: exp-weighted values, weight sums, row maxima."""
    s = jnp.einsum("hqd,hkd->hqk", q, k) / math.sqrt(q.shape[-1])
    if causal:
        rows = q_start + jnp.arange(q.shape[1])[:, None]
        cols = k_start + jnp.arange(k.shape[1])[None, :]
        s = jnp.where(cols <= rows, s, jnp.finfo(s.dtype).min)
    m = lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
    w = jnp.exp(s - m)
    return jnp.einsum("hqk,hkd->hqd", w, v), w.sum(-1), m[..., 0]


def _query_chunk(q, k, v, q_start, key_chunk: int, causal: bool):
    """Attention of one query chunk against all keys, in key chunks."""
    lk = k.shape[1]
    n_chunks = lk // key_chunk
    block = jax.checkpoint(functools.partial(_key_chunk, causal=causal), prevent_cse=False)

    def one(start):
        kc = lax.dynamic_slice_in_dim(k, start, key_chunk, axis=1)
        vc = lax.dynamic_slice_in_dim(v, start, key_chunk, axis=1)
        return block(q, kc, vc, q_start, start)

    values, sums, maxes = lax.map(one, jnp.arange(n_chunks) * key_chunk)
    top = jnp.max(maxes, axis=0)
    scale = jnp.exp(maxes - top)
    total = jnp.sum(values * scale[..., None], axis=0)
    norm = jnp.sum(sums * scale, axis=0)
    return total / norm[..., None]


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    causal: bool = False,
    query_chunk: int = 1024,
    key_chunk: int = 4096,
) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v, chunked; lengths must be multiples of the chunk sizes (or
    shorter than them)."""
    h, lq = q.shape[:2]
    query_chunk, key_chunk = min(query_chunk, lq), min(key_chunk, k.shape[1])
    if lq % query_chunk or k.shape[1] % key_chunk:
        raise ValueError(
            f"chunked attention: lengths ({lq}, {k.shape[1]}) must be multiples of the chunk "
            f"sizes ({query_chunk}, {key_chunk})"
        )
    per_chunk = jax.checkpoint(
        functools.partial(_query_chunk, key_chunk=key_chunk, causal=causal), prevent_cse=False
    )

    def step(_, start):
        qc = lax.dynamic_slice_in_dim(q, start, query_chunk, axis=1)
        return None, per_chunk(qc, k, v, start)

    _, out = lax.scan(step, None, jnp.arange(lq // query_chunk) * query_chunk)
    return out.transpose(1, 0, 2, 3).reshape(h, lq, v.shape[-1])


def attention_loss(q, k, v, causal: bool = False, query_chunk: int = 1024, key_chunk: int = 4096):
    """The same loss as ``examples.attention.attention_loss``, on the chunked attention."""
    return 0.5 * jnp.sum(attention(q, k, v, causal, query_chunk, key_chunk) ** 2)


attention_value_and_grad = jax.value_and_grad(attention_loss, argnums=(0, 1, 2))
