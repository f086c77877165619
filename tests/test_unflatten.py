"""The unflatten pass: reshape chains fold, and reductions over merged axes run on the unmerged
value, with the flat program's answers (argmax ties, NaN and inf included); programs that
flattened their largest value now split under a limit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import memsafe
from memsafe.graph import inline_calls
from memsafe.graph.interpret import evaluate
from memsafe.passes.unflatten import reshape_groups, unflatten
from memsafe.xla import memsafe_jit
from tests.limits import limit_between


def test_reshape_groups():
    assert reshape_groups((4, 5), (20,)) == [((0, 1), (0,))]
    assert reshape_groups((4, 5, 1), (20,)) == [((0, 1, 2), (0,))]
    assert reshape_groups((2, 3, 4), (6, 4)) == [((0, 1), (0,)), ((2,), (1,))]
    assert reshape_groups((6, 4), (2, 3, 2, 2)) == [((0,), (0, 1)), ((1,), (2, 3))]
    assert reshape_groups((1, 6), (6,)) == [((0,), ()), ((1,), (0,))]
    assert reshape_groups((3, 0), (0,)) is None


def _rewritten(fun, *args):
    """``fun``'s program after the pass, and what the pass changed."""
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    changes: list[str] = []
    return unflatten(closed, changes), changes


def _same(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        if g.dtype.kind in "biu":
            np.testing.assert_array_equal(g, w)
        else:
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5, equal_nan=True)


def _check(fun, *args):
    """The pass changes ``fun`` and the rewritten program gives jax.jit's answers."""
    new, changes = _rewritten(fun, *args)
    assert changes, "the pass left the program as it was"
    assert not any(e.primitive.name == "reshape" and len(e.invars[0].aval.shape) > 1
                   and len(e.outvars[0].aval.shape) == 1 for e in new.jaxpr.eqns)  # fmt: skip
    assert "jit" not in {e.primitive.name for e in new.jaxpr.eqns}  # the split pass sees it all
    got = jax.jit(lambda *a: evaluate(new, a))(*args)
    _same(got, memsafe_jit(fun)(*args))
    return changes


#: Values drawn from a small set, so ties are common; NaN and infinities among them.
_SPECIAL = st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0, np.inf, -np.inf, np.nan])


@given(
    shape=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    data=st.data(),
    op=st.sampled_from(["argmax", "argmin"]),
    dtype=st.sampled_from([np.float32, np.int32]),
)
def test_arg_extremes_of_a_flat_value_are_the_flat_ones(shape, data, op, dtype):
    """argmax/argmin over all of a value or over a trailing merged block: the flat program's
    index, for ties, NaN, inf and -0.0 (values drawn from a small set)."""
    size = int(np.prod(shape))
    values = data.draw(st.lists(_SPECIAL, min_size=size, max_size=size))
    x = np.asarray(values, np.float32).reshape(shape)
    if dtype is np.int32:
        x = np.nan_to_num(x, nan=3, posinf=4, neginf=-4).astype(np.int32)
    merge_from = data.draw(st.integers(0, len(shape) - 2))
    keep = shape[:merge_from]
    pick = getattr(jnp, op)
    if int(np.prod(shape[merge_from:])) == max(shape[merge_from:]):
        return  # no two axes longer than one merge: nothing to rewrite

    def flat(x):
        return pick(jnp.sin(x).reshape(*keep, -1), axis=-1), pick(x)

    _check(flat, x)


@pytest.mark.parametrize(
    "fun",
    [
        lambda x: jnp.sum(jnp.exp(x).reshape(-1)),
        lambda x: jnp.max(jnp.exp(x).reshape(x.shape[0], -1), axis=1),
        lambda x: jnp.min(jnp.exp(x).ravel()),
        lambda x: jnp.prod(jnp.tanh(x).reshape(-1) * 0.01 + 1),
        lambda x: jnp.any(x.reshape(-1) > 1.5),
        lambda x: jnp.exp(x).reshape(-1).reshape(x.shape).sum(0),
        lambda x: jnp.exp(x).reshape(2, -1).reshape(-1, x.shape[-1]).max(1),
    ],
)
def test_reductions_and_chains(fun):
    x = np.random.default_rng(0).standard_normal((6, 4, 5)).astype(np.float32)
    _check(fun, x)


def test_inside_loop_bodies_and_branches():
    x = np.random.default_rng(1).standard_normal((3, 4, 5)).astype(np.float32)

    def fun(x):
        mapped = lax.map(lambda r: jnp.argmax(jnp.exp(r)), x)
        branch = lax.cond(x[0, 0, 0] > 0, lambda: jnp.argmin(x), lambda: jnp.argmax(x))
        return mapped, branch

    changes = _check(fun, x)
    assert any("argmax" in c for c in changes) and any("argmin" in c for c in changes)


def test_unmerged_programs_are_left_alone():
    x = jnp.ones((4, 6))
    for fun in (lambda x: x.reshape(2, 2, 6).sum(1), lambda x: jnp.argmax(x, 1), jnp.sum):
        closed = inline_calls(jax.make_jaxpr(fun)(x))
        assert unflatten(closed, []) is closed


@pytest.mark.parametrize(
    "fun",
    [
        lambda x, y: jnp.argmax(jnp.exp(-jnp.abs(x @ y.T))),  # the best pair, over all pairs
        lambda x, y: jnp.min(jnp.sin(x @ y.T).reshape(-1).reshape(x.shape[0], -1), axis=0),
        lambda x, y: jnp.mean(jnp.cos(x @ y.T).ravel()),
    ],
    ids=["argmax_all", "flat_roundtrip", "mean_ravel"],
)
def test_flattened_programs_split_under_a_quarter(fun):
    """Programs that flatten their largest value run under a quarter of jax.jit's temporaries
    (each was refused before this pass: the reshape merged the split axis)."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 8)).astype(np.float32)
    y = rng.standard_normal((2048, 8)).astype(np.float32)
    x[7, 3] = np.nan
    limit = limit_between(fun, (x, y), 1 / 4)
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(x, y)
    assert plan.splits and plan.after.total <= limit, plan
    assert any(r.pass_name == "unflatten" for r in plan.passes)
    _same(f(x, y), memsafe_jit(fun)(x, y))
