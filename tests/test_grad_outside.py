"""A gradient taken outside memsafe differentiates only the perturbed inputs, from the non-zero
cotangents, so it needs no more than jax.jit's own gradient (issue 11, defect 5)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe.xla import Footprint, memsafe_jit
from tests.agree import assert_like_jit


def loss(x, w):
    return jnp.sum(jnp.tanh(x @ w) ** 2)


def _data():
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    return jax.random.normal(kx, (64, 256)), jax.random.normal(kw, (256, 4096)) / 16


def test_gradient_of_one_argument_needs_no_more_than_jax_jit():
    """With argnums=0 the gradient w.r.t. the large w is never computed: at jax.jit(grad)'s own
    footprint memsafe succeeds, where differentiating every input cannot (its outputs alone
    would exceed the limit)."""
    x, w = _data()
    reference = memsafe_jit(jax.grad(loss, argnums=0))
    limit = Footprint.from_compiled(reference.lower(x, w).compile()).total
    f = memsafe.jit(loss, memory_limit=limit)
    with pytest.raises(memsafe.MemoryLimitError, match="arguments and outputs alone"):
        f.backward_plan(x, w)  # every float input differentiated
    got = jax.grad(f, argnums=0)(x, w)
    assert_like_jit(got, jax.grad(loss, argnums=0), x, w)
    backward = f.plan(x, w).backward
    assert backward is not None and backward.after.total <= limit
    assert backward.after.outputs == x.nbytes  # the gradient of x only


def test_unused_outputs_take_no_cotangent():
    """Only the outputs the loss uses feed the backward program; the values are jax.jit's."""

    def two(x, w):
        h = x @ w
        return jnp.sum(jnp.tanh(h) ** 2), h  # h is big and unused by the loss

    x, w = _data()
    f = memsafe.jit(two, memory_limit="64MiB")
    got = jax.grad(lambda a, b: f(a, b)[0], argnums=(0, 1))(x, w)
    want = memsafe_jit(jax.grad(lambda a, b: two(a, b)[0], argnums=(0, 1)))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    backward = f.plan(x, w).backward
    assert backward.after.arguments == x.nbytes + w.nbytes + 4  # no cotangent for h


def test_integer_and_unperturbed_inputs_get_no_gradient():
    def f(x, idx, scale):
        return jnp.sum(x[idx] * scale)

    x = jnp.arange(12.0).reshape(4, 3)
    idx = jnp.array([0, 2, 2])
    g = memsafe.jit(f, memory_limit="1MiB")
    got = jax.grad(g, argnums=(0, 2))(x, idx, 2.0)
    want = memsafe_jit(jax.grad(f, argnums=(0, 2)))(x, idx, 2.0)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b)
