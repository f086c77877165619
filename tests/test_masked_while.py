"""While loops whose predicate is ``any`` of a mask carried along the split axis (issue 41):
``while it < most and jnp.any(active)``, the body turning ``active`` off per position and keeping
the other carries where it is off, as batched solvers are written by hand. Each chunk's loop
runs until its own positions are done; the counter is the furthest chunk's."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe.split.registry import PLAIN, NoRule, axis_map
from tests.limits import limit_between, plan_fitting


def _iterate(w: jax.Array, h: jax.Array, most: int = 60, tol: float = 1e-4, **kw: Any) -> Any:
    """A fixed point per row: ``z = tanh(z @ w + h)`` until the row moved less than ``tol``."""

    def keep_going(state: Any) -> Any:
        it, _, active = state[:3]
        return (it < most) & jnp.any(active)

    def step(state: Any) -> Any:
        it, z, active = state[:3]
        new = jnp.tanh(z @ w + h)
        delta = jnp.max(jnp.abs(new - z), axis=-1)
        # unmasked: finished rows keep changing, so the chunks would not agree with the loop
        z = new if kw.get("unmasked") else jnp.where(active[:, None], new, z)
        if kw.get("summed"):
            return it + 1, z, active & (delta > tol), state[3] + jnp.sum(delta)
        return it + 1, z, active & (delta > tol)

    init = (0, jnp.zeros_like(h), jnp.ones(h.shape[:-1], bool))
    if kw.get("summed"):
        init = (*init, jnp.zeros((), h.dtype))
    return lax.while_loop(keep_going, step, init)


def _rows(rows: int = 2048, d: int = 32, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    """Weights and inputs whose rows converge after different numbers of iterations: the gain
    of each row's input varies tenfold."""
    rng = np.random.default_rng(seed)
    w = jnp.asarray(rng.standard_normal((d, d)) * 0.9 / np.sqrt(d), jnp.float32)
    gain = np.geomspace(0.1, 1.0, rows)[rng.permutation(rows)][:, None]
    x = jnp.asarray(rng.standard_normal((rows, d)) * gain, jnp.float32)
    return w, x


def _layer(w: jax.Array, x: jax.Array) -> Any:
    h = jnp.tanh(x @ w)  # the large value, made before the loop
    it, z, _ = _iterate(w, h)
    return jnp.sum(z**2), it


def test_an_any_of_a_mask_loop_splits_along_its_rows_with_the_loops_counter():
    w, x = _rows()
    plan = plan_fitting(_layer, (w, x))
    assert any("while" in s for s in map(str, plan.splits)), plan
    # the rows stop at different iterations: the counter is the furthest chunk's, the loop's
    got = memsafe.jit(_layer, memory_limit=plan.memory_limit)(w, x)[1]
    ref = jax.jit(_layer)(w, x)[1]
    assert int(got) == int(ref) > 5
    # the counter started from a Python 0: weakly typed, as jax.jit's
    assert got.weak_type == ref.weak_type


def test_the_iteration_bound_stops_every_chunk_as_it_stops_the_loop():
    w, x = _rows(seed=1)

    def bounded(w: jax.Array, x: jax.Array) -> Any:
        it, z, active = _iterate(w, jnp.tanh(x @ w), most=4)
        return z, it, active

    plan_fitting(bounded, (w, x))


def test_nan_and_infinity_rows_keep_jax_jits_answers():
    w, x = _rows(seed=2)
    x = x.at[5].set(jnp.nan).at[700, 3].set(jnp.inf).at[1500].set(-jnp.inf)

    def rows_out(w: jax.Array, x: jax.Array) -> Any:
        it, z, active = _iterate(w, jnp.tanh(x @ w))
        return z, it, active

    plan_fitting(rows_out, (w, x))


def test_its_gradient_through_a_mask_loop_under_custom_vjp_fits():
    """The solver sample's equilibrium layer: the fixed point under ``custom_vjp``, its backward
    a fixed number of adjoint steps; the gradient of a loss of it w.r.t. the weights."""

    @jax.custom_vjp
    def equilibrium(w: jax.Array, h: jax.Array) -> jax.Array:
        return _iterate(w, h)[1]

    def fwd(w: jax.Array, h: jax.Array) -> Any:
        z = _iterate(*lax.stop_gradient((w, h)))[1]
        return z, (w, h, z)

    def bwd(res: Any, ct: jax.Array) -> Any:
        w, h, z = res
        _, vjp_z = jax.vjp(lambda z: jnp.tanh(z @ w + h), z)
        u = lax.fori_loop(0, 8, lambda _, u: ct + vjp_z(u)[0], ct)
        _, vjp_wh = jax.vjp(lambda w, h: jnp.tanh(z @ w + h), w, h)
        return vjp_wh(u)

    equilibrium.defvjp(fwd, bwd)

    def loss(w: jax.Array, x: jax.Array) -> jax.Array:
        return jnp.mean(equilibrium(w, jnp.tanh(x @ w)) ** 2)

    w, x = _rows(1024)
    plan_fitting(jax.grad(loss), (w, x), 0.5)


def _loop_eqn(**kw: Any) -> Any:
    w, x = _rows(256, 16)
    eqns = jax.make_jaxpr(lambda w, h: _iterate(w, h, **kw))(w, jnp.tanh(x @ w)).jaxpr.eqns
    (loop,) = [e for e in eqns if e.primitive.name == "while"]
    return loop


def test_a_body_that_changes_rows_whose_mask_is_off_is_refused_by_name():
    with pytest.raises(NoRule, match=r"changes carry 1 .* where that mask is off"):
        axis_map(_loop_eqn(unmasked=True), ("out", 1), 0, PLAIN)


def test_a_sum_over_the_rows_under_a_mask_predicate_is_refused():
    with pytest.raises(NoRule, match="sums over the split axis into carry 3"):
        axis_map(_loop_eqn(summed=True), ("out", 1), 0, PLAIN)


def test_a_predicate_that_reduces_rows_otherwise_still_couples_them():
    """``any(delta > tol)`` computed in the predicate from the rows (not a mask the body
    carries) is refused as before: a chunk stops when its own rows agree."""

    def fun(x: jax.Array) -> Any:
        def keep_going(state: Any) -> Any:
            return jnp.any(jnp.abs(state[1]) > 1.0)

        return lax.while_loop(keep_going, lambda s: (s[0] + 1, s[1] * 0.5), (0, x))

    x = jnp.ones((512, 8)) * 4.0
    (loop,) = [e for e in jax.make_jaxpr(fun)(x).jaxpr.eqns if e.primitive.name == "while"]
    with pytest.raises(NoRule, match="couples the positions"):
        axis_map(loop, ("out", 1), 0, PLAIN)


def test_a_limit_under_the_rows_is_still_met_or_refused_never_exceeded():
    w, x = _rows(1024, 32)
    limit = limit_between(_layer, (w, x), 0.05)
    try:
        plan = memsafe.jit(_layer, memory_limit=limit).plan(w, x)
    except memsafe.MemoryLimitError:
        return
    assert plan.after.total <= limit
