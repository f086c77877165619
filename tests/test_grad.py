"""Gradients of memsafe functions: the backward program is rewritten and verified too."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import memsafe


def _loss(x, y, v):
    k = jnp.exp(-jnp.sum((x[:, None] - y[None]) ** 2, -1) / 2)
    return jnp.sum((k @ v) ** 2)


def test_backward_program_uses_the_rewritten_forward():
    """The gradient differentiates |x|^2 + |y|^2 - 2xy^T, so no n*m*d value is ever split."""
    kx, ky, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (300, 8))
    y = jax.random.normal(ky, (4000, 8))
    v = jax.random.normal(kv, (4000,))
    limit = 1_000_000
    f = memsafe.jit(_loss, memory_limit=limit)
    grads = jax.grad(f, argnums=(0, 1, 2))(x, y, v)
    want = jax.grad(_loss, argnums=(0, 1, 2))(x, y, v)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-3 * float(jnp.abs(w).max()))
    back = f.backward_plan(x, y, v)
    assert back.after.total <= limit
    assert any(r.rule == "pairwise_sqdist" for r in back.rules)
    n_m_d = 300 * 4000 * 8 * 4
    assert all(s.bytes < n_m_d for s in back.splits)
    assert jax.jit(jax.grad(f))(x, y, v).shape == x.shape


def test_custom_derivative_rules_survive_in_the_gradient():
    """jax.nn.relu and logsumexp carry custom JVPs; the memsafe gradient must use them."""

    def f(x):
        return jax.scipy.special.logsumexp(jax.nn.relu(x) * 1e3, axis=1).sum()

    x = jnp.concatenate([jnp.zeros((4, 1)), jnp.linspace(-1, 1, 20).reshape(4, 5)], axis=1)
    g = memsafe.jit(f, memory_limit="1MiB")
    np.testing.assert_allclose(jax.grad(g)(x), jax.grad(f)(x), rtol=1e-6)
