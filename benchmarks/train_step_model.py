"""A GPT-style model's training step, as a user writes it and as it is hand-tuned for memory.

The model: token embedding, ``blocks`` pre-LN causal transformer blocks (4 heads, MLP 4x wide),
a final layer norm, logits through the tied embedding, mean cross-entropy of the next token.

- :func:`loss` is the user's code: a Python loop over a list of blocks' parameters.
- :func:`scan_loss` is the same model as users of flax's ``nn.scan`` or equinox's stacked
  layers write it: the blocks stacked (:func:`stacked`) and run by ``lax.scan``, with no
  checkpoint.
- :func:`hand_tuned_grad` is what a user writes to save memory by hand: the blocks stacked and run
  by ``lax.scan`` with ``jax.checkpoint`` around each block (activations rematerialized in the
  backward pass), and the batch split into micro-batches whose gradients are summed
  (``lax.scan`` over them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Config:
    """Sizes of the model and its batch."""

    batch: int = 4
    length: int = 1024
    width: int = 256
    heads: int = 4
    blocks: int = 4
    vocab: int = 512


def init(cfg: Config, seed: int = 0) -> dict[str, Any]:
    """Parameters: ``embed`` [vocab, width] and ``blocks``, a list of per-block dicts."""
    keys = jax.random.split(jax.random.PRNGKey(seed), cfg.blocks + 1)
    d = cfg.width

    def block(key: jax.Array) -> dict[str, jax.Array]:
        k = jax.random.split(key, 6)
        mats = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, 4 * d)}
        out = {n: jax.random.normal(kk, s) / np.sqrt(s[0]) for kk, (n, s) in zip(k, mats.items())}
        out["w2"] = jax.random.normal(k[5], (4 * d, d)) / np.sqrt(8 * d)
        return {"ln1": jnp.ones(d), "ln2": jnp.ones(d), **out}

    embed = jax.random.normal(keys[0], (cfg.vocab, d)) / np.sqrt(d)
    return {"embed": embed, "ln": jnp.ones(d), "blocks": [block(k) for k in keys[1:]]}


def tokens(cfg: Config, seed: int = 1) -> jax.Array:
    """A batch of random token ids, int32[batch, length + 1] (inputs and next-token targets)."""
    key = jax.random.PRNGKey(seed)
    return jax.random.randint(key, (cfg.batch, cfg.length + 1), 0, cfg.vocab, jnp.int32)


def _layer_norm(x: jax.Array, gain: jax.Array) -> jax.Array:
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * gain


def block(p: dict[str, jax.Array], x: jax.Array, heads: int) -> jax.Array:
    """One pre-LN causal block on ``x`` [batch, length, width]."""
    b, length, d = x.shape
    h = _layer_norm(x, p["ln1"])
    q, k, v = [(h @ p[n]).reshape(b, length, heads, d // heads) for n in ("wq", "wk", "wv")]
    s = jnp.einsum("blhd,bmhd->bhlm", q, k) / np.sqrt(d // heads)
    s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -1e9)
    o = jnp.einsum("bhlm,bmhd->blhd", jax.nn.softmax(s, -1), v).reshape(b, length, d)
    x = x + o @ p["wo"]
    return x + jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["w1"]) @ p["w2"]


def _head(params: dict[str, Any], x: jax.Array, ids: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of the final hidden states ``x``."""
    logits = _layer_norm(x, params["ln"]) @ params["embed"].T
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[..., 1:, None], -1))


def loss(params: dict[str, Any], ids: jax.Array, heads: int = 4) -> jax.Array:
    """The user's training loss: a Python loop over the blocks."""
    x = params["embed"][ids[:, :-1]]
    for p in params["blocks"]:
        x = block(p, x, heads)
    return _head(params, x, ids)


def stacked(params: dict[str, Any]) -> dict[str, Any]:
    """The same parameters with the blocks stacked along a leading axis (for ``lax.scan``)."""
    return {**params, "blocks": jax.tree.map(lambda *b: jnp.stack(b), *params["blocks"])}


def scan_loss(params: dict[str, Any], ids: jax.Array, heads: int = 4) -> jax.Array:
    """The user's training loss with the blocks stacked and run by ``lax.scan``."""
    x = params["embed"][ids[:, :-1]]
    x, _ = jax.lax.scan(lambda x, p: (block(p, x, heads), None), x, params["blocks"])
    return _head(params, x, ids)


def _scanned_loss(params: dict[str, Any], ids: jax.Array, heads: int) -> jax.Array:
    x = params["embed"][ids[:, :-1]]
    step = jax.checkpoint(lambda x, p: (block(p, x, heads), None))
    x, _ = jax.lax.scan(step, x, params["blocks"])
    return _head(params, x, ids)


def hand_tuned_grad(params: dict[str, Any], ids: jax.Array, micro: int, heads: int = 4) -> Any:
    """Loss and gradient (for :func:`stacked` parameters) by scan + checkpoint over the blocks
    and ``micro`` micro-batches of the batch, gradients averaged."""
    parts = ids.reshape(micro, ids.shape[0] // micro, ids.shape[1])
    value_and_grad = jax.value_and_grad(_scanned_loss)

    def accumulate(acc: Any, part: jax.Array) -> tuple[Any, None]:
        value, grads = value_and_grad(params, part, heads)
        return jax.tree.map(jnp.add, acc, (value, grads)), None

    zero = jax.tree.map(jnp.zeros_like, (jnp.float32(0), params))
    total, _ = jax.lax.scan(accumulate, zero, parts)
    return jax.tree.map(lambda t: t / micro, total)
