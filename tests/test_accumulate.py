"""The accumulate pass: a scan's carry summed from zeros and read after the loop only through
operations linear in it is replaced by their results, summed in every iteration
(``memsafe.passes.accumulate``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe._jax import jaxpr_as_fun
from memsafe.graph import inline_calls
from memsafe.passes import accumulate
from memsafe.passes.base import PassContext
from memsafe.plan import Plan
from tests.agree import assert_like_jit
from tests.limits import limit_between

T, N, M = 5, 96, 80


def _inputs():
    rng = np.random.default_rng(5)
    xs = rng.standard_normal((T, N), dtype=np.float32)
    w = rng.standard_normal((N, M), dtype=np.float32)
    v = rng.standard_normal((M, 3), dtype=np.float32)
    xs[2, 7], w[3, 4] = np.nan, np.inf
    return tuple(map(jnp.asarray, (xs, w, v)))


def _summed(read, start=None):
    """A scan summing a [N, M] term per step from ``start`` (zeros), read by ``read``."""

    def fun(xs, w, v):
        def step(c, x):
            return c + jnp.tanh(x[:, None] * w) + jnp.cos(x)[:, None], None

        c0 = jnp.zeros((N, M)) if start is None else start(w)
        c, _ = lax.scan(step, c0, xs)
        return read(c, v)

    return fun


LINEAR = _summed(lambda c, v: (c @ v, jnp.sum(2.0 * c, 0)))  # two results, both small


def _rewritten(fun, args):
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    plan = Plan(memory_limit=1)
    return accumulate.run(closed, PassContext(1, 0, plan)), plan


def test_a_linear_read_is_summed_in_the_loop():
    """The [N, M] carry is gone: the scan carries the two small results, with jax.jit's
    answers (NaN and inf in the inputs)."""
    args = _inputs()
    new, plan = _rewritten(LINEAR, args)
    assert [r.pass_name for r in plan.records] == ["accumulate"]
    (scan,) = [e for e in new.jaxpr.eqns if e.primitive.name == "scan"]
    assert all(o.aval.shape != (N, M) for o in scan.outvars), scan.outvars
    got = jax.tree.unflatten(jax.tree.structure(LINEAR(*args)), jaxpr_as_fun(new)(*args))
    assert_like_jit(got, LINEAR, *args)


@pytest.mark.parametrize(
    "fun",
    [
        _summed(lambda c, v: jnp.sum(c**2)),  # not linear
        _summed(lambda c, v: (c @ v, c)),  # the carry itself is a result
        _summed(lambda c, v: c[:, :60]),  # the map's result is not much smaller
        _summed(lambda c, v: c @ v, start=lambda w: w),  # summed from a value, not zeros
    ],
    ids=["square", "carry-out", "large-result", "nonzero-start"],
)
def test_other_reads_are_left_alone(fun):
    _, plan = _rewritten(fun, _inputs())
    assert not plan.records


def test_the_carry_read_inside_the_loop_is_left_alone():
    """A carry the body reads other than by adding to it is no sum of the iterations'
    terms."""

    def fun(xs, w, v):
        def step(c, x):
            return c * 0.5 + jnp.tanh(x[:, None] * w), None

        return lax.scan(step, jnp.zeros((N, M)), xs)[0] @ v

    _, plan = _rewritten(fun, _inputs())
    assert not plan.records


def test_a_gradient_through_a_loop_over_a_large_value():
    """The gradient of a loop reading a [N, M] value every step, made from small inputs: the
    backward accumulates its cotangent, here reduced to the inputs' in every step, under a
    limit below one [N, M] value, with jax.jit's answers. (The Sinkhorn gradient of
    ``test_split_loops`` was refused without the pass.)"""

    def loss(a, b, xs):
        w = jnp.sin(a[:, None] - b[None, :])  # [N, M] from [N] and [M]

        def step(h, x):
            return x + jnp.sum(jnp.tanh(w * h[None, :]), 0) / N, None

        return jnp.sum(lax.scan(step, jnp.zeros(M), xs)[0])

    rng = np.random.default_rng(1)
    a = jnp.asarray(rng.standard_normal(N, dtype=np.float32))
    b = jnp.asarray(rng.standard_normal(M, dtype=np.float32))
    xs = jnp.asarray(rng.standard_normal((T, M), dtype=np.float32))
    fun = jax.grad(loss, (0, 1))
    limit = limit_between(fun, (a, b, xs), 0.05)
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(a, b, xs)
    assert "accumulate" in [r.pass_name for r in plan.passes], plan
    assert plan.after.total <= limit
    assert_like_jit(f(a, b, xs), fun, a, b, xs)
