"""A while loop whose predicate ties the positions of its state (it runs while any is unfinished)
counts its iterations first on the carries its predicate needs, then runs that many: every chunk
of the state then runs the whole loop's iterations (``memsafe.passes.trips``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import memsafe
from memsafe.passes import trips
from memsafe.xla import memsafe_jit
from tests.agree import assert_like_jit

B, D, SLOTS = 2048, 64, 32


def _adaptive(w, y0, rates):
    """A batch of trajectories stepping until each reaches t = 1 (per-position step sizes), the
    state saved every step into a slot chosen by the shared step counter, as a checkpointing
    solver does; finished positions are kept, their saved slots are not."""

    def cond(state):
        k, t, _, _ = state
        return jnp.any(t < 1.0) & (k < 200)

    def body(state):
        k, t, y, saved = state
        on = t < 1.0
        dt = rates * (1.0 + 0.5 * jnp.tanh(jnp.mean(y, -1)))
        y_new = y + dt[:, None] * jnp.tanh(y @ w)
        saved = lax.dynamic_update_slice_in_dim(saved, y[:, None, :], k % SLOTS, axis=1)
        return (
            k + 1,
            jnp.where(on, t + dt, t),
            jnp.where(on[:, None], y_new, y),
            saved,
        )

    saved = jnp.zeros((y0.shape[0], SLOTS, D), y0.dtype)
    k, _, y, saved = lax.while_loop(cond, body, (0, jnp.zeros(y0.shape[0]), y0, saved))
    return k, jnp.sum(y, -1), jnp.sum(saved, (1, 2))


def _args():
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((D, D)) * D**-0.5, jnp.float32)
    y0 = jnp.asarray(rng.standard_normal((B, D)), jnp.float32)
    rates = jnp.asarray(rng.uniform(0.02, 0.2, B), jnp.float32)
    return w, y0, rates


def _limit(f, args, share=4):
    m = memsafe_jit(f).lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes // share


def test_a_loop_that_runs_while_any_position_is_unfinished_splits_after_counting():
    args = _args()
    limit = _limit(_adaptive, args)
    f = memsafe.jit(_adaptive, memory_limit=limit)
    plan = f.plan(*args)  # refused before: the predicate couples the positions
    assert any(getattr(r, "pass_name", "") == "trips" for r in plan.records), plan
    assert any("while" in s.ops for s in plan.splits), plan
    assert plan.after.total <= limit
    got = f(*args)
    assert int(got[0]) == int(jax.jit(_adaptive)(*args)[0])  # the trip count, exactly
    assert_like_jit(got, _adaptive, *args)


def test_the_counting_loop_keeps_only_what_the_predicate_needs():
    eqn = next(e for e in jax.make_jaxpr(_adaptive)(*_args()).eqns if e.primitive.name == "while")
    # counter, t and y (t's step reads y); not the saved states
    assert trips.counting_carries(eqn) == [0, 1, 2]
    assert trips.worth_counting(eqn, budget=1 << 40) is None  # fits: left as it is
    assert trips.worth_counting(eqn, budget=4 << 20) == [0, 1, 2]


def test_a_loop_whose_predicate_needs_all_of_its_state_is_left_as_it_is():
    def cg_like(a, b):
        def cond(s):
            return jnp.linalg.norm(s[1]) > 1e-3

        def body(s):
            x, r = s
            return x + 0.1 * r, r - 0.1 * (a @ r)

        return lax.while_loop(cond, body, (jnp.zeros_like(b), b))[0]

    a, b = jnp.eye(64) * 2.0, jnp.ones(64)
    eqn = next(e for e in jax.make_jaxpr(cg_like)(a, b).eqns if e.primitive.name == "while")
    assert trips.counting_carries(eqn) == [1]
    assert trips.worth_counting(eqn, budget=16) is None  # counting would hold half of it
