"""Loops: a large value made inside a loop body is split inside the body (each iteration runs the
chunked body), under the limit and equal to jax.jit; lax.map runs its rows in chunks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe.xla import Footprint, memsafe_jit

N, M = 64, 20_000


def _fori(x, y):
    def body(i, acc):
        s = jnp.exp(-((x[:, None] - y[None, :]) ** 2) * (i + 1.0))  # a large value per iteration
        return acc + jnp.max(s, 1)

    return lax.fori_loop(0, 3, body, jnp.zeros(N))


def _while(x, y):
    def body(c):
        i, acc = c
        s = jnp.sin(x[:, None] * y[None, :] + i)
        return i + 1, acc + jnp.argmax(s, 1).astype(jnp.float32)

    return lax.while_loop(
        lambda c: c[0] < jnp.sum(x > -10).astype(jnp.float32) / N * 2, body, (0.0, jnp.zeros(N))
    )[1]


def _map(x, y):
    return jnp.sum(lax.map(lambda r: jnp.exp(-((r - y) ** 2)), x), 0)


@pytest.mark.parametrize("fun", [_fori, _while, _map], ids=["fori", "while", "map"])
def test_large_values_in_loops_split_under_the_limit(fun):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(N, dtype=np.float32))
    y = jnp.asarray(rng.standard_normal(M, dtype=np.float32))
    y = y.at[7].set(jnp.nan)
    plain = Footprint.from_compiled(memsafe_jit(fun).lower(x, y).compile())
    fixed = plain.arguments + plain.outputs
    limit = fixed + (plain.total - fixed) // 4
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(x, y)
    assert plan.splits and plan.after.total <= limit, plan
    np.testing.assert_allclose(f(x, y), memsafe_jit(fun)(x, y), rtol=1e-5)
