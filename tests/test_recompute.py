"""The recomputation pass: cheap loop-invariant values are recomputed inside loop bodies.

Measured (jax 0.10.2, CPU, memsafe's compile options, 64^3): seed 002's f_filter_with_temp holds
its k-mesh for the whole loop (2.16 MB of temps); f_filter_with_recalc regenerates it in the loop
body (1.08 MB).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from examples.seed002 import f_filter_with_recalc, f_filter_with_temp, get_kmesh
from memsafe._jax import eval_jaxpr
from memsafe.context import PassContext
from memsafe.graph import inline_calls
from memsafe.passes import recompute
from memsafe.plan import Plan
from memsafe.xla import memsafe_jit


def _temps(fun, *args) -> int:
    return memsafe_jit(fun).lower(*args).compile().memory_analysis().temp_size_in_bytes


def _run_pass(fun, *args):
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    ctx = PassContext(memory_limit=1, fixed_bytes=0, plan=Plan(1))
    new = recompute.run(closed, ctx)
    return new, ctx, lambda *a: eval_jaxpr(new.jaxpr, new.consts, *a)


@pytest.fixture(scope="module")
def rho():
    return jax.random.normal(jax.random.key(0), (64, 64, 64), jnp.float32)


def test_filter_with_temp_reaches_recalc_temps(rho):
    bad, good = _temps(f_filter_with_temp, rho), _temps(f_filter_with_recalc, rho)
    assert bad > 1.9 * good  # 2.16 MB vs 1.08 MB
    limit = 2 * rho.nbytes + good + 32 * 1024  # arguments + outputs + the good form's temps
    g = memsafe.jit(f_filter_with_temp, memory_limit=limit)
    plan = g.plan(rho)
    stats = g.lower(rho).compile().memory_analysis()
    assert stats.temp_size_in_bytes <= good
    assert plan.after.total <= limit
    (rec,) = [r for r in plan.passes if r.pass_name == "recompute"]
    assert rec.bytes_saved == 64 * 64 * 33 * 4 and "iota" in rec.data["ops"]
    np.testing.assert_allclose(g(rho), jax.jit(f_filter_with_temp)(rho), rtol=1e-6, atol=1e-6)


def test_scan_inside_while_body_is_processed(rho):
    """While-loop constants stay (XLA hoists them back out); a scan in the while body is
    rewritten, and the program still computes the same values."""

    def f(r, steps):
        def body(c):
            i, v = c

            def step(j, w):
                wk = jnp.fft.rfftn(w) * jnp.exp(-0.5 * k2)
                return jnp.fft.irfftn(wk, s=w.shape)

            k2 = get_kmesh(r, norm2=True) * (i + 1.0)
            return i + 1, jax.lax.fori_loop(0, 2, step, v)

        return jax.lax.while_loop(lambda c: c[0] < steps, body, (0, r))[1]

    steps = jnp.int32(2)
    _, ctx, g = _run_pass(f, rho, steps)
    assert [r.data["loop"] for r in ctx.plan.passes] == ["scan"]
    assert ctx.plan.passes[0].data["depth"] == 1
    np.testing.assert_allclose(jax.jit(g)(rho, steps)[0], jax.jit(f)(rho, steps), rtol=1e-5)


def test_nested_loop_and_argument_leaf():
    """Inner loop constants derived from outer-body values and a program argument move too."""

    def f(x):
        def outer(i, acc):
            mesh = jnp.sin(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) * (i + 1.0))
            wide = x * 2.0 + mesh

            def inner(j, a):
                return jnp.tanh(a @ wide.T @ a) * 0.1

            return jax.lax.fori_loop(0, 3, inner, acc)

        return jax.lax.fori_loop(0, 2, outer, x)

    x = jax.random.normal(jax.random.key(1), (256, 256)) * 0.1
    _, ctx, g = _run_pass(f, x)
    assert {r.data["depth"] for r in ctx.plan.passes} == {1}
    np.testing.assert_allclose(jax.jit(g)(x)[0], jax.jit(f)(x), rtol=1e-5, atol=1e-6)


def test_expensive_or_small_constants_stay():
    def f(a, b):
        heavy = a @ b  # a dot: not cheap, stays outside
        small = jnp.arange(16.0)  # below the size threshold

        def body(i, v):
            return v @ heavy * 0.01 + small.sum()

        return jax.lax.fori_loop(0, 3, body, a)

    a = jnp.ones((256, 256))
    closed = inline_calls(jax.make_jaxpr(f)(a, a))
    ctx = PassContext(memory_limit=1, fixed_bytes=0, plan=Plan(1))
    assert recompute.run(closed, ctx) is closed and not ctx.plan.records


def _layers_under_a_causal_mask(ws, x):
    """A scan over layers reading a causal mask broadcast to ``[heads, L, L]`` outside the loop
    (as JAX hoists it): a constant of the loop, as large as the attention scores."""
    n = x.shape[1]
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((n, n), bool)), (x.shape[0], n, n))

    def layer(h, w):
        s = jnp.where(mask, jnp.einsum("hqd,hkd->hqk", h, h @ w), -jnp.inf)
        return jnp.tanh(jax.nn.softmax(s, -1) @ h), None

    return jnp.sum(jax.lax.scan(layer, x, ws)[0])


def test_the_split_makes_large_invariants_inside_the_bodies_it_splits():
    """Held outside the loop, the mask stays whole beside the split body; the split pass moves
    its making into the body first (a recompute record), then chunks it with the scores."""
    rng = np.random.default_rng(0)
    ws = jnp.asarray(rng.standard_normal((3, 16, 16)) / 4, jnp.float32)
    x = jnp.asarray(rng.standard_normal((4, 512, 16)), jnp.float32)
    mask_bytes = 4 * 512 * 512
    f = memsafe.jit(_layers_under_a_causal_mask, memory_limit=3 * mask_bytes)
    plan = f.plan(ws, x)
    records = plan.records
    last_split = max(k for k, r in enumerate(records) if r in plan.splits)
    moved = [
        k
        for k, r in enumerate(records)
        if getattr(r, "pass_name", "") == "recompute" and "bool[" in r.description
    ]
    assert moved and moved[0] < last_split, plan  # moved by the split pass, before its splits
    assert plan.after.total <= 3 * mask_bytes, plan
    np.testing.assert_allclose(f(ws, x), memsafe_jit(_layers_under_a_causal_mask)(ws, x), rtol=2e-5)


@pytest.mark.parametrize(("room", "moves"), [(64 << 20, False), (160 << 10, True)])
def test_the_floor_for_moving_a_constant_follows_the_room(room, moves):
    """A 16 KiB mask read by a loop: under the 64 KiB floor, it is held where the room is large,
    and recomputed inside the loop where it is a tenth of the room (a program and its limit
    scaled down together move the same constants)."""

    def f(x):
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((128, 128), bool)), (1, 128, 128))

        def body(i, v):
            return jnp.where(mask, v * 0.5, v)

        return jax.lax.fori_loop(0, 3, body, x)

    x = jnp.ones((1, 128, 128))
    closed = inline_calls(jax.make_jaxpr(f)(x))
    ctx = PassContext(memory_limit=room, fixed_bytes=0, plan=Plan(room))
    new = recompute.run(closed, ctx)
    assert bool(ctx.plan.records) == moves, ctx.plan.records
    got = eval_jaxpr(new.jaxpr, new.consts, x)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(f(x)))
