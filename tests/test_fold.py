"""The fold pass: small values a program computes from no argument become constants, as XLA's
constant folding makes them in jax.jit's program (fuzz seed 11300)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import memsafe
from memsafe import policy
from memsafe._jax import jaxpr_as_fun, make_closed_jaxpr
from memsafe.context import PassContext
from memsafe.passes import fold
from memsafe.plan import Plan
from memsafe.xla import Footprint, memsafe_jit


def _names(closed):
    return [e.primitive.name for e in closed.jaxpr.eqns]


def _folded(fun, *avals):
    closed, _ = make_closed_jaxpr(fun, avals)
    return closed, fold.run(closed, PassContext(1 << 30, 0, Plan(1 << 30)))


def test_small_argument_free_values_become_constants_and_large_ones_stay():
    x = jax.ShapeDtypeStruct((1000, 1000), jnp.float32)

    def f(x):
        count = jnp.sum(-jnp.ones((20, 440)))  # argument-free, summed to a scalar
        return x / count + jnp.ones((1000, 1000))  # argument-free, 4 MB: stays a broadcast

    before, after = _folded(f, x)
    assert "reduce_sum" in _names(before) and "reduce_sum" not in _names(after)
    assert "broadcast_in_dim" in _names(after)
    assert all(np.asarray(c).nbytes <= policy.REWRITE.fold_bytes for c in after.consts)
    xs = jnp.arange(1e6, dtype=jnp.float32).reshape(1000, 1000)
    np.testing.assert_array_equal(jaxpr_as_fun(after)(xs)[0], f(xs))


def test_keys_effects_and_programs_with_nothing_to_fold_are_left_alone():
    x = jax.ShapeDtypeStruct((8,), jnp.float32)

    def f(x):
        return x * jax.random.normal(jax.random.key(0), (8,))

    before, after = _folded(f, x)
    assert after is before  # the key's values are not folded: nothing changes

    def g(x):
        return x * 2.0

    before, after = _folded(g, x)
    assert after is before


def test_a_gradient_zero_by_cancellation_stays_exactly_zero_when_split():
    """``sum(s - mean(s))`` is zero whatever ``s``, and so is its gradient: jax.jit folds the
    cotangent's ``1 - sum(ones) / n`` to 0; split, memsafe's loop computed it with XLA's
    reciprocal and one rounding, 2.1e-6 (fuzz seed 11300)."""
    rng = np.random.default_rng(11300)
    x = jnp.asarray(rng.standard_normal((20, 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((440, 3)), jnp.float32)

    def loss(x, y):
        s = jnp.max(jnp.abs(x[:, None, :] - y[None, :, :]), -1)
        s = jnp.flip(s, 0)
        return jnp.sum(s - jnp.mean(s))

    grad = jax.grad(loss, argnums=(0, 1))
    compiled = memsafe_jit(grad).lower(x, y).compile()
    jit_fp = Footprint.from_compiled(compiled)
    limit = jit_fp.arguments + jit_fp.outputs + jit_fp.temps // 2
    safe = memsafe.jit(grad, memory_limit=limit)
    got = safe(x, y)
    plan = safe.plan(x, y)
    assert plan.splits and plan.after.total <= limit
    for g, r in zip(got, compiled(x, y)):
        assert not np.asarray(r).any()  # jax.jit: exactly zero
        np.testing.assert_array_equal(g, r)
