"""Staged splits whose later loops compare values they recompute
(``memsafe.split.strategies.recompute``): the gradient of a maximum compares each value with the
maximum the first loop found, so every loop must compute those values alike. Such a split runs
without peephole moves or tiles, and the split pass does not split its loops' bodies again (fuzz
seed 716: a second loop's body, split along a contraction, summed in another order and matched no
value to the minimum)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe._jax import LOOP_BODIES, programs
from memsafe.context import PassContext
from memsafe.graph import Graph
from memsafe.graph.interpret import inline_calls
from memsafe.plan import Plan
from memsafe.split import planner, program
from memsafe.split.region import grow
from memsafe.split.strategies import recompute
from memsafe.split.strategies.staged import StagedSplit
from memsafe.xla import memsafe_jit


def _ties_of_the_minimum(x, y):
    """How many columns equal each row's minimum: the later loop compares with the minimum."""
    s = x @ y.T
    return jnp.sum(s == jnp.min(s, 1, keepdims=True), 1)


def _centred(x, y):
    """A later loop that recomputes but compares nothing."""
    s = x @ y.T
    return jnp.sum(jnp.tanh(s - jnp.mean(s, 1, keepdims=True)), 1)


def _grad_of_the_minimum(x, y):
    return jax.grad(lambda x: jnp.sum(jnp.min(x @ y.T, 1)))(x)


X, Y = jnp.ones((64, 8)), jnp.ones((4096, 8))


@pytest.mark.parametrize(
    ("fun", "same"), [(_ties_of_the_minimum, True), (_grad_of_the_minimum, True), (_centred, False)]
)
def test_a_later_loop_comparing_recomputed_values_computes_them_alike(fun, same):
    graph = Graph(inline_calls(jax.make_jaxpr(fun)(X, Y)))
    seed = next(e.outvars[0] for e in graph.eqns if e.primitive.name == "dot_general")
    region = grow(graph, seed, 1, 1, 10**9)
    split = planner.strategy(graph, region)
    assert isinstance(split, StagedSplit) and region.n_stages >= 2
    assert recompute.decides_on_recomputed(graph, region) is same
    assert split.same is same


def _split_top(fun):
    closed = inline_calls(jax.make_jaxpr(fun)(X, Y))
    budget = 64 << 10
    ctx = PassContext(memory_limit=budget, fixed_bytes=0, plan=Plan(memory_limit=budget))
    return program._split_top(closed, ctx), ctx


def test_the_loops_of_such_a_split_are_not_split_again():
    """The split pass returns the loops' bodies to keep; splitting the bodies leaves those
    loops exactly as emitted, however small the budget."""
    (new, kept), ctx = _split_top(_ties_of_the_minimum)
    assert [s.stages for s in ctx.plan.splits] == [2]
    loops = [e for e in new.jaxpr.eqns if e.primitive.name in LOOP_BODIES]
    assert loops and all(kept.get(id(b.jaxpr)) is b for e in loops for b in programs(e))
    tiny = PassContext(memory_limit=64, fixed_bytes=0, plan=Plan(memory_limit=64))
    again = program._split_bodies(new, kept, tiny)
    assert again is new or [e.params for e in again.jaxpr.eqns] == [
        e.params for e in new.jaxpr.eqns
    ]
    assert tiny.plan.splits == []


def test_other_staged_splits_keep_their_bodies_open():
    (_, kept), ctx = _split_top(_centred)
    assert [s.stages for s in ctx.plan.splits] == [2] and kept == {}


def test_the_gradient_of_a_minimum_with_ties_under_a_limit():
    """End to end: ties (small integers) and a NaN row; every tie count is found in the
    recomputing loop, so the gradient has jax.jit's answer (no 0/0)."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-2, 3, (64, 8)), jnp.float32)
    y = jnp.asarray(rng.integers(-2, 3, (4096, 8)), jnp.float32).at[5, 3].set(jnp.nan)
    want = memsafe_jit(_grad_of_the_minimum)(x, y)
    f = memsafe.jit(_grad_of_the_minimum, memory_limit="300KiB")
    got = f(x, y)
    assert any(s.stages == 3 for s in f.plan(x, y).splits)
    np.testing.assert_array_equal(got, want)
