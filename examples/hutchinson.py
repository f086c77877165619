"""Hutchinson's trace estimator of seeds 000/001, written as the seeds write it.

For every point of every batch, estimate tr(dv/dx) of a small MLP vector field v(x, z, t) with
Rademacher probes: E[eps^T (dv/dx) eps]. The context z (B, Dc) and time t (B, 1) are tiled to
(B, N, ...) so that two nested ``vmap`` calls can use ``in_axes=0`` everywhere (seed 001).

Run as a script: ``python -m examples.hutchinson --B 64 --N 1000 --D 2 --Dc 512``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp


def init_mlp(key: jax.Array, d: int, dc: int, hidden: int = 64) -> dict[str, jax.Array]:
    """A small MLP vector field R^(d + dc + 1) -> R^d."""
    k1, k2, k3 = jax.random.split(key, 3)
    din = d + dc + 1
    return {
        "w1": jax.random.normal(k1, (din, hidden)) / jnp.sqrt(din),
        "b1": jnp.zeros(hidden),
        "w2": jax.random.normal(k2, (hidden, hidden)) / jnp.sqrt(hidden),
        "b2": jnp.zeros(hidden),
        "w3": jax.random.normal(k3, (hidden, d)) / jnp.sqrt(hidden),
    }


def vector_field(params, x_point, z_ctx, t_val):
    """v(x, z, t) for one point: concatenate [x, z, t] and apply the MLP."""
    h = jnp.concatenate([x_point, z_ctx, jnp.reshape(t_val, (1,))])
    h = jnp.tanh(h @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    return h @ params["w3"]


def hutchinson_trace(params, x_point, z_ctx, t_val, mask_val, key, n_probes: int = 1):
    """Trace estimate of d v / d x at one point, masked."""
    eps = jax.random.rademacher(key, (n_probes, x_point.shape[0]), dtype=x_point.dtype)

    def one(e):
        _, jvp = jax.jvp(lambda x: vector_field(params, x, z_ctx, t_val), (x_point,), (e,))
        return jnp.dot(e, jvp)

    return jnp.mean(jax.vmap(one)(eps)) * mask_val


def traces_tiled(params, x_t, z, t, mask, key, n_probes: int = 1):
    """Seed 001's form: tile z and t to (B, N, ...) and vmap twice with in_axes=0."""
    b, n, _ = x_t.shape
    z_array = jnp.tile(z[:, None, :], (1, n, 1))
    t_array = jnp.tile(t, (1, n))
    keys = jax.random.split(key, b * n).reshape(b, n, -1)
    inner = jax.vmap(
        lambda x, zc, tv, m, k: hutchinson_trace(params, x, zc, tv, m, k, n_probes),
        in_axes=(0, 0, 0, 0, 0),
    )
    return jax.vmap(inner, in_axes=(0, 0, 0, 0, 0))(x_t, z_array, t_array, mask, keys)


def traces_broadcast(params, x_t, z, t, mask, key, n_probes: int = 1):
    """The untiled form: in_axes=None for the context, the same estimates for the same key."""
    b, n, _ = x_t.shape
    keys = jax.random.split(key, b * n).reshape(b, n, -1)
    inner = jax.vmap(
        lambda x, zc, tv, m, k: hutchinson_trace(params, x, zc, tv, m, k, n_probes),
        in_axes=(0, None, None, 0, 0),
    )
    return jax.vmap(inner, in_axes=(0, 0, 0, 0, 0))(x_t, z, t[:, 0], mask, keys)


def make_inputs(b: int, n: int, d: int, dc: int, seed: int = 0):
    """Random inputs of the seeds' shapes: x_t (B, N, D), z (B, Dc), t (B, 1), mask (B, N)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 5)
    params = init_mlp(keys[0], d, dc)
    x_t = jax.random.normal(keys[1], (b, n, d))
    z = jax.random.normal(keys[2], (b, dc))
    t = jax.random.uniform(keys[3], (b, 1))
    mask = jnp.ones((b, n))
    return params, x_t, z, t, mask, keys[4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--N", type=int, default=1000)
    parser.add_argument("--D", type=int, default=2)
    parser.add_argument("--Dc", type=int, default=512)
    args = parser.parse_args()
    inputs = make_inputs(args.B, args.N, args.D, args.Dc)
    compiled = jax.jit(traces_tiled).lower(*inputs).compile()
    print(compiled.memory_analysis())
    print(jax.jit(traces_tiled)(*inputs).mean())


if __name__ == "__main__":
    main()
