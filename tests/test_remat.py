"""The remat pass: a forward scan's stacked residuals, read only by the backward scan, are
recomputed there per iteration from each iteration's carry when they would take more than a
share of the temporaries' budget (``memsafe.passes.remat``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe._jax import ClosedJaxpr, jaxpr_as_fun
from memsafe.context import PassContext
from memsafe.graph import Graph
from memsafe.passes import remat
from memsafe.plan import Plan
from memsafe.xla import Footprint, memsafe_jit
from tests.agree import assert_like_jit
from tests.limits import limit_between

T, B, D, F = 6, 256, 32, 512


def _inputs():
    rng = np.random.default_rng(3)
    ws = rng.standard_normal((T, D, F), dtype=np.float32) / 6
    vs = rng.standard_normal((T, F, D), dtype=np.float32) / 24
    x = rng.standard_normal((B, D), dtype=np.float32)
    x[11, 2] = np.nan
    x[12, 0] = np.inf
    return tuple(map(jnp.asarray, (ws, vs, x)))


def _mlp_layers(ws, vs, x):
    """Residual MLP blocks as a scan over stacked weights: each saves a [B, F] activation."""

    def block(h, w):
        a, b = w
        return h + jnp.tanh(jnp.tanh(h @ a) @ b), None

    return lax.scan(block, x, (ws, vs))[0]


def _rnn(ws, vs, x):
    """A recurrent cell over time: the carry [B, D], a wide [B, F] value per step."""

    def step(h, w):
        a, b = w
        z = jnp.exp(-jnp.square(h @ a))
        return jnp.tanh(z @ b + h), jnp.sum(z, 1)

    h, zs = lax.scan(step, x, (ws, vs))
    return jnp.sum(jnp.nan_to_num(h) ** 2) + jnp.sum(jnp.nan_to_num(zs))


def _grad_mlp(ws, vs, x):
    return jax.grad(lambda ws, vs: jnp.sum(jnp.nan_to_num(_mlp_layers(ws, vs, x)) ** 2), (0, 1))(
        ws, vs
    )


@pytest.mark.parametrize(
    "fun, fraction", [(_grad_mlp, 1 / 5), (jax.grad(_rnn, (0, 1, 2)), 1 / 4)], ids=["layers", "rnn"]
)
def test_residuals_are_recomputed_under_a_tight_limit(fun, fraction):
    """Gradients of scans over layers and over time, with NaN and inf inputs."""
    args = _inputs()
    limit = limit_between(fun, args, fraction)
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(*args)
    assert plan.after.total <= limit, plan
    assert any(r.pass_name == "remat" for r in plan.passes), plan
    assert plan.recompute_flops > 0
    assert_like_jit(f(*args), fun, *args)


def _pass(fun, args, budget):
    closed = jax.make_jaxpr(fun)(*args)
    ctx = PassContext(memory_limit=budget, fixed_bytes=0, plan=Plan(memory_limit=budget))
    return closed, remat.run(closed, ctx), ctx


def test_the_forward_scan_stacks_its_carry_instead_of_the_residuals():
    args = _inputs()
    before, after, ctx = _pass(_grad_mlp, args, budget=1)
    assert isinstance(after, ClosedJaxpr) and len(ctx.plan.records) == 1

    def stacked(closed):
        g = Graph(closed)
        fwd = next(e for e in closed.jaxpr.eqns if e.primitive.name == "scan")
        return sum(g.info(o).bytes for o in fwd.outvars)

    assert stacked(after) * 4 < stacked(before)
    want, got = jax.jit(_grad_mlp)(*args), jax.jit(jaxpr_as_fun(after))(*args)
    for w, g in zip(jax.tree.leaves(want), got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_small_residuals_are_kept():
    """Residuals under half of the budget stay stacked: the program is returned unchanged."""
    before, after, ctx = _pass(_grad_mlp, _inputs(), budget=2**40)
    assert ctx.plan.records == [] and after is before


def test_a_checkpointed_body_has_nothing_to_recompute():
    """A body under ``jax.checkpoint`` already stacks only its carry: nothing changes."""

    def fun(ws, vs, x):
        def block(h, w):
            a, b = w
            return h + jnp.tanh(jnp.tanh(h @ a) @ b), None

        body = jax.checkpoint(block)
        return jax.grad(lambda ws: jnp.sum(lax.scan(body, x, (ws, vs))[0] ** 2))(ws)

    before, after, ctx = _pass(fun, _inputs(), budget=1)
    assert ctx.plan.records == [] and after is before


def test_fits_where_a_hand_written_checkpoint_fits():
    """The plain layers' gradient under the footprint of the same gradient written with
    ``jax.checkpoint`` around the scan body by hand: memsafe rematerializes and fits it."""
    args = _inputs()

    def hand(ws, vs, x):
        def block(h, w):
            a, b = w
            return h + jnp.tanh(jnp.tanh(h @ a) @ b), None

        body = jax.checkpoint(block)
        loss = lambda ws, vs: jnp.sum(jnp.nan_to_num(lax.scan(body, x, (ws, vs))[0]) ** 2)
        return jax.grad(loss, (0, 1))(ws, vs)

    limit = Footprint.from_compiled(memsafe_jit(hand).lower(*args).compile()).total
    plan = memsafe.jit(_grad_mlp, memory_limit=limit).plan(*args)
    assert plan.after.total <= limit < plan.before.total, plan
    assert any(r.pass_name == "remat" for r in plan.passes), plan


def test_a_literal_initial_carry():
    """A scan whose initial carry is a literal (``0.0``): the pass weighs it by its aval (it
    raised on the literal, found by fuzz seed 812)."""
    ws, _, x = _inputs()
    x = jnp.nan_to_num(x)

    def fun(ws, x):
        def step(c, w):
            z = jnp.tanh(x @ w + c)  # the residuals read the carry
            return jnp.tanh(c + jnp.mean(z)), jnp.sum(z, 1)

        return jax.grad(lambda ws: jnp.sum(lax.scan(step, 0.0, ws)[1]))(ws)

    before, after, ctx = _pass(fun, (ws, x), budget=1)
    scans = [e for e in before.jaxpr.eqns if e.primitive.name == "scan"]
    assert any(type(a).__name__ == "Literal" for e in scans for a in e.invars)
    assert len(ctx.plan.records) == 1
    assert_like_jit(jax.jit(jaxpr_as_fun(after))(ws, x)[0], fun, ws, x)


def test_the_forward_keeps_its_decisions():
    """A maximum's gradient reads which operand won. Recomputed in another compile a tie could
    go the other way (fuzz seed 1871 gave 40 NaNs where jax.jit gives 19): the forward stacks
    its comparisons' results, the backward reads them, and ties fall as in jax.jit."""
    ws, _, x = _inputs()

    def fun(ws, x):
        def step(h, w):
            s = h @ w[:, :D]
            s = s.at[:, 0].set(0.0)  # exact ties of s and s / 2
            return jnp.tanh(jnp.maximum(s, 0.5 * s) + jnp.stack([s, 2 * s]).max(0)), None

        return jax.grad(lambda ws: jnp.sum(jnp.nan_to_num(lax.scan(step, x, ws)[0])))(ws)

    _, after, ctx = _pass(fun, (ws, x), budget=1)
    assert len(ctx.plan.records) == 1
    fwd = next(e for e in after.jaxpr.eqns if e.primitive.name == "scan")
    assert any(o.aval.dtype == jnp.bool_ for o in fwd.outvars)  # the decisions, stacked
    assert_like_jit(jax.jit(jaxpr_as_fun(after))(ws, x)[0], fun, ws, x)


def test_decisions_inside_a_loop_of_the_body_stay_stored():
    """A comparison inside a loop of the body cannot be stacked by the forward: such
    residuals are not recomputed."""
    ws, _, x = _inputs()

    def fun(ws, x):
        def step(h, w):
            s = h @ w[:, :D]
            return jnp.tanh(lax.fori_loop(0, 2, lambda _, s: jnp.maximum(s, 0.5 * s), s)), None

        return jax.grad(lambda ws: jnp.sum(lax.scan(step, x, ws)[0]))(ws)

    before, after, ctx = _pass(fun, (ws, x), budget=1)
    assert ctx.plan.records == [] and after is before
