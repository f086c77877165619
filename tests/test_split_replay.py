"""Loops replayed per chunk of an accumulator (memsafe.split.strategies.replay): a backward loop
that sums a large invariant's cotangent over its iterations, whose other carries are sums over the
whole term, runs once per chunk of that sum, exactly, where nothing else splits it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from examples import sinkhorn
from memsafe.graph.interpret import inline_calls
from memsafe.split.strategies import replay
from tests.agree import assert_like_jit
from tests.limits import limit_between

N, M = 256, 320


def _coupled(x, y):
    """A loop whose term couples rows and columns through two small carries, summed into an
    accumulator as large as ``x @ y.T``; the accumulator is then reduced along its rows."""
    c = x @ y.T

    def step(carry, _):
        acc, u, v = carry
        t = jnp.tanh(c + u[:, None] - v[None, :])
        return (acc + t, u + jnp.mean(t, 1), v + jnp.mean(t, 0)), None

    init = (jnp.zeros_like(c), jnp.zeros(x.shape[0]), jnp.zeros(y.shape[0]))
    (acc, u, v), _ = lax.scan(step, init, None, length=4)
    return jnp.sum(acc * c, 1) + u, v


def _inputs(special: bool):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((N, 8), dtype=np.float32)
    y = rng.standard_normal((M, 8), dtype=np.float32)
    if special:
        x[5, 2], y[7, 1], y[9, 0] = np.nan, np.inf, -np.inf
    return jnp.asarray(x), jnp.asarray(y)


@pytest.mark.parametrize("special", [False, True], ids=["finite", "nan-inf"])
def test_a_loop_whose_carries_couple_rows_and_columns_replays_per_chunk(special):
    """Before: refused, best 1000.4 KiB ("a loop carry takes the split axis in but not out" on
    both axes)."""
    x, y = _inputs(special)
    limit = limit_between(_coupled, (x, y), 0.0) + N * M * 4 // 2  # half of x @ y.T
    f = memsafe.jit(_coupled, memory_limit=limit)
    plan = f.plan(x, y)
    assert plan.after.total <= limit, plan
    assert any("scan" in s.ops for s in plan.splits), plan
    assert_like_jit(f(x, y), _coupled, x, y)


def test_the_sinkhorn_gradient_fits_below_its_cost_matrix():
    """The gradient's backward loop sums the cost matrix's cotangent over the iterations; the
    limit leaves room for a sixth of the matrix. Before: refused, best 981.3 KiB."""
    x, y = (jnp.asarray(a) for a in sinkhorn.make_inputs(256, 192))

    def loss(x, y):
        f, g = sinkhorn.sinkhorn(x, y, steps=4)
        return jnp.sum(f) + jnp.sum(g)

    fun = jax.grad(loss, argnums=(0, 1))
    matrix = 256 * 192 * 4
    limit = limit_between(fun, (x, y), 0.0) + matrix // 6
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(x, y)
    assert plan.after.total <= limit, plan
    assert_like_jit(f(x, y), fun, x, y)


def _body(fun, *args):
    scan = next(e for e in jax.make_jaxpr(fun)(*args).jaxpr.eqns if e.primitive.name == "scan")
    return inline_calls(scan.params["jaxpr"]).jaxpr


def test_an_accumulator_is_a_carry_only_added_to():
    def chain(acc, t):
        return acc + jnp.sin(t) + jnp.cos(t), t

    def scaled(acc, t):  # read otherwise than by the additions
        return 0.5 * acc + t, t

    def read(acc, t):  # the sum read by another result too
        s = acc + t
        return s, jnp.sum(s) + t

    def out_twice(acc, t):
        return acc + t, acc

    a, xs = jnp.zeros((3, 4)), jnp.ones((5, 3, 4))
    run = lambda step: lambda a, xs: lax.scan(step, a, xs)
    assert replay.accumulator_adds(_body(run(chain), a, xs), 0, 0) is not None
    for step in (scaled, read, out_twice):
        assert replay.accumulator_adds(_body(run(step), a, xs), 0, 0) is None, step.__name__


def _cg_loss(x, y):
    """Conjugate gradients on a kernel matrix of ``x`` (10 steps of a ``fori_loop``)."""
    n = x.shape[0]
    k = jnp.exp(-jnp.sum((x[:, None] - x[None]) ** 2, -1)) + jnp.eye(n)

    def step(i, c):
        a, r, p, rr = c
        kp = k @ p
        alpha = rr / (p @ kp)
        a, r = a + alpha * p, r - alpha * kp
        rn = r @ r
        return a, r, r + rn / rr * p, rn

    a, *_ = lax.fori_loop(0, 10, step, (jnp.zeros(n), y, y, y @ y))
    return jnp.sum(a)


def test_the_gradient_of_conjugate_gradients_fits_below_its_kernel_matrix():
    """The backward loop sums the kernel matrix's cotangent (``p`` times a cotangent, per step).
    Before: refused, best 5.0 MiB (at n=1024 under 1 MiB: best 20.0 MiB, jax.jit's own)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((512, 3), dtype=np.float32))
    y = jnp.asarray(rng.standard_normal(512, dtype=np.float32))
    fun = jax.grad(_cg_loss)
    limit = limit_between(fun, (x, y), 0.0) + 512 * 512 * 4 // 4
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(x, y)
    assert plan.after.total <= limit, plan
    assert_like_jit(f(x, y), fun, x, y)
