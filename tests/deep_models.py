"""Deep programs of issue 12 as a user writes them: a pre-LN causal transformer (plain JAX,
flax.linen as a Python loop and as ``nn.scan`` over layers, equinox), a tanh MLP, and their
training steps.

Every builder returns ``(loss, params, batch)``: ``loss(params, *batch)`` is a scalar.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class Shape:
    """A transformer's sizes: blocks, batch, sequence, width, heads."""

    blocks: int = 4
    batch: int = 4
    length: int = 1024
    width: int = 256
    heads: int = 4


Model = tuple[Callable[..., Any], Any, tuple[Any, ...]]


def _batch(s: Shape) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (s.batch, s.length, s.width))
    return x, jax.random.normal(ky, (s.batch, s.length, s.width))


def _layer_norm(x: jax.Array, gain: jax.Array) -> jax.Array:
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + 1e-5) * gain


def _attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention of ``[..., L, heads, d]`` queries, keys and values."""
    length, d = q.shape[-3], q.shape[-1]
    s = jnp.einsum("...lhd,...mhd->...hlm", q, k) / np.sqrt(d)
    s = jnp.where(jnp.tril(jnp.ones((length, length), bool)), s, -1e9)
    return jnp.einsum("...hlm,...mhd->...lhd", jax.nn.softmax(s, -1), v)


def _block_params(key: jax.Array, d: int) -> dict[str, jax.Array]:
    k = jax.random.split(key, 6)
    shapes = {"wq": (d, d), "wk": (d, d), "wv": (d, d), "wo": (d, d), "w1": (d, 4 * d)}
    params = {n: jax.random.normal(kk, sh) / 16 for kk, (n, sh) in zip(k, shapes.items())}
    params["w2"] = jax.random.normal(k[5], (4 * d, d)) / 32
    return {"ln1": jnp.ones(d), "ln2": jnp.ones(d), **params}


def _block(p: dict[str, jax.Array], x: jax.Array, heads: int) -> jax.Array:
    *lead, length, d = x.shape
    h = _layer_norm(x, p["ln1"])
    q, k, v = [(h @ p[n]).reshape(*lead, length, heads, d // heads) for n in ("wq", "wk", "wv")]
    x = x + _attention(q, k, v).reshape(*lead, length, d) @ p["wo"]
    return x + jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["w1"]) @ p["w2"]


def transformer(s: Shape = Shape(), checkpointed: bool = False) -> Model:
    """The issue's model in plain JAX: a Python loop over a list of blocks' parameters
    (``checkpointed``: ``jax.checkpoint`` around each block)."""
    keys = jax.random.split(jax.random.PRNGKey(0), s.blocks)
    params = [_block_params(k, s.width) for k in keys]
    block = jax.checkpoint(_block, static_argnums=2) if checkpointed else _block

    def loss(params, x, y):
        for p in params:
            x = block(p, x, s.heads)
        return jnp.mean((x - y) ** 2)

    return loss, params, _batch(s)


def _flax_block(s: Shape) -> Any:
    import flax.linen as nn

    class Block(nn.Module):
        """One pre-LN causal block; ``(x, None) -> (x, None)`` so that nn.scan can run it."""

        @nn.compact
        def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
            *lead, length, d = x.shape

            def dense(n: int) -> Any:
                return nn.Dense(n, use_bias=False)

            h = nn.LayerNorm(use_bias=False)(x)
            q, k, v = [dense(d)(h).reshape(*lead, length, s.heads, d // s.heads) for _ in "qkv"]
            x = x + dense(d)(_attention(q, k, v).reshape(*lead, length, d))
            h = nn.LayerNorm(use_bias=False)(x)
            return x + dense(d)(nn.gelu(dense(4 * d)(h))), None

    return Block


def flax_model(s: Shape = Shape(), scan: bool = False) -> Model:
    """The same model in flax.linen: a Python loop of blocks, or ``nn.scan`` over stacked layers."""
    import flax.linen as nn

    block = _flax_block(s)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            if scan:
                layers = nn.scan(
                    block,
                    variable_axes={"params": 0},
                    split_rngs={"params": True},
                    length=s.blocks,
                )
                return layers()(x, None)[0]
            for _ in range(s.blocks):
                x = block()(x)[0]
            return x

    model = Model()
    x, y = _batch(s)
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(params, x, y):
        return jnp.mean((model.apply(params, x) - y) ** 2)

    return loss, params, (x, y)


def equinox_model(s: Shape = Shape()) -> Model:
    """The same model in equinox: modules acting on one sequence, vmapped over the batch."""
    import equinox as eqx

    class Block(eqx.Module):
        norms: tuple[eqx.nn.LayerNorm, eqx.nn.LayerNorm]
        qkvo: tuple[eqx.nn.Linear, ...]
        mlp: tuple[eqx.nn.Linear, eqx.nn.Linear]

        def __init__(self, key: jax.Array) -> None:
            d, k = s.width, jax.random.split(key, 6)
            self.norms = tuple(eqx.nn.LayerNorm(d, use_bias=False) for _ in range(2))
            self.qkvo = tuple(eqx.nn.Linear(d, d, use_bias=False, key=k[i]) for i in range(4))
            self.mlp = (
                eqx.nn.Linear(d, 4 * d, use_bias=False, key=k[4]),
                eqx.nn.Linear(4 * d, d, use_bias=False, key=k[5]),
            )

        def __call__(self, x: jax.Array) -> jax.Array:  # [L, D]
            length, d = x.shape
            h = jax.vmap(self.norms[0])(x)
            q, k, v = [jax.vmap(f)(h).reshape(length, s.heads, d // s.heads) for f in self.qkvo[:3]]
            x = x + jax.vmap(self.qkvo[3])(_attention(q, k, v).reshape(length, d))
            h = jax.vmap(self.norms[1])(x)
            return x + jax.vmap(self.mlp[1])(jax.nn.gelu(jax.vmap(self.mlp[0])(h)))

    blocks = [Block(k) for k in jax.random.split(jax.random.PRNGKey(0), s.blocks)]

    def loss(blocks, x, y):
        def one(x):
            for b in blocks:
                x = b(x)
            return x

        return jnp.mean((jax.vmap(one)(x) - y) ** 2)

    return loss, blocks, _batch(s)


def mlp(batch: int = 8192, width: int = 512, layers: int = 8) -> Model:
    """The issue's tanh MLP: ``layers`` square layers over a batch, a mean of squares."""
    keys = jax.random.split(jax.random.PRNGKey(0), layers + 1)
    ws = [jax.random.normal(k, (width, width)) / np.sqrt(width) for k in keys[:-1]]
    x = jax.random.normal(keys[-1], (batch, width))

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x**2)

    return loss, ws, (x,)


def adam_step(
    loss: Callable[..., Any], params: Any, learning_rate: float = 1e-3
) -> tuple[Callable[..., Any], Any]:
    """A full optax training step of ``loss`` (gradient then Adam's update) and Adam's initial
    state for ``params``: ``step(params, state, *batch)`` gives the new parameters, the new
    state and the loss."""
    import optax

    opt = optax.adam(learning_rate)

    def step(params, state, *batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    return step, opt.init(params)
