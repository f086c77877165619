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


def test_backward_plan_describes_the_gradient_that_ran():
    """After ``jax.grad(f, argnums=0)`` ran, ``backward_plan`` is that program's plan (issue 39:
    it planned every float input's gradient and raised); ``argnums`` asks for one before."""
    x, w = _data()
    reference = memsafe_jit(jax.grad(loss, argnums=0))
    limit = Footprint.from_compiled(reference.lower(x, w).compile()).total
    fresh = memsafe.jit(loss, memory_limit=limit)
    asked = fresh.backward_plan(x, w, argnums=0)
    assert asked.after.total <= limit and asked.after.outputs == x.nbytes
    with pytest.raises(ValueError, match="argnums 2"):
        fresh.backward_plan(x, w, argnums=2)
    f = memsafe.jit(loss, memory_limit=limit)
    jax.grad(f, argnums=0)(x, w)
    ran = f.backward_plan(x, w)
    assert ran is f.plan(x, w).backward and ran.after.outputs == x.nbytes
    with pytest.raises(memsafe.MemoryLimitError):
        f.backward_plan(x, w, argnums=(0, 1))  # w's gradient alone is over the limit


def test_backward_plan_argnums_counts_pytrees_and_static_arguments():
    """``argnums`` selects every array of a pytree argument, after static arguments."""

    def tree_loss(scale, params, x):
        return jnp.sum(jnp.tanh(x @ params["w"] + params["b"]) ** 2) * scale

    x, w = _data()
    params = {"w": w, "b": jnp.zeros(w.shape[1])}
    f = memsafe.jit(tree_loss, memory_limit="1GiB", static_argnums=0)
    plan = f.backward_plan(2.0, params, x, argnums=1)
    tuple_table = 2 * 8  # XLA's table of the two outputs' addresses
    assert plan.after.outputs == w.nbytes + params["b"].nbytes + tuple_table
    assert f.backward_plan(2.0, params, x, argnums=2).after.outputs == x.nbytes
    with pytest.raises(ValueError, match="static"):
        f.backward_plan(2.0, params, x, argnums=0)


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
    # no cotangent for h; the loss's, jax.grad's seed 1.0, is built into the program
    assert backward.after.arguments == x.nbytes + w.nbytes


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


def test_jax_grads_seed_is_built_into_the_backward_program():
    """``jax.grad`` seeds a scalar loss's cotangent with the concrete 1.0: the backward program
    takes it as a constant, as ``jax.jit(jax.grad(f))`` does, and a gradient zero by
    cancellation is then exactly jax.jit's 0 (fuzz seed 11524: taken at run time, XLA's
    reciprocal and fused multiply-add made it 4.1e-6). Another cotangent is an argument."""
    rng = np.random.default_rng(11524)
    x = jnp.asarray(rng.standard_normal((40, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((900, 3)), jnp.float32)

    def loss(x, y):
        s = jnp.outer(x[:, 0], y[:, 0])
        s = jnp.stack([s, s * 2.0]).max(0)
        return jnp.sum(s - jnp.mean(s))

    want = memsafe_jit(jax.grad(loss, argnums=(0, 1)))(x, y)
    fp = Footprint.from_compiled(memsafe_jit(jax.grad(loss, argnums=(0, 1))).lower(x, y).compile())
    safe = memsafe.jit(loss, memory_limit=fp.arguments + fp.outputs + fp.temps // 3)
    got = jax.grad(safe, argnums=(0, 1))(x, y)
    backward = safe.plan(x, y).backward
    assert backward.splits and backward.after.arguments == x.nbytes + y.nbytes
    for g, r in zip(got, want):
        assert not np.asarray(r).any()
        np.testing.assert_array_equal(g, r)
    _, pullback = jax.vjp(safe, x, y)  # a cotangent of 2.0: an argument of another program
    for g, r in zip(pullback(jnp.float32(2.0)), jax.vjp(loss, x, y)[1](jnp.float32(2.0))):
        np.testing.assert_allclose(g, r, atol=1e-5)
