"""The distribute pass: operations after a large concatenation, pad or stack run on its pieces,
with jax.jit's answers (ties, NaN and inf included); programs whose largest value was built from
pieces along the axis they split on now split under a limit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import memsafe
from memsafe.graph import inline_calls
from memsafe.graph.interpret import evaluate
from memsafe.passes.distribute import distribute
from memsafe.xla import memsafe_jit
from tests.limits import limit_between


def _rewritten(fun, *args, threshold=0):
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    changes: list[str] = []
    return distribute(closed, threshold, changes), changes


def _same(got, want):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        np.testing.assert_array_equal(g, w)


def _names(closed):
    return [e.primitive.name for e in closed.jaxpr.eqns]


#: Values from a small set, so ties are common; NaN and infinities among them.
_SPECIAL = st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0, np.inf, -np.inf, np.nan])

#: Programs building a value from pieces along an axis, then mapping or reducing it exactly.
PIECES = {
    "concat_rows_sort": lambda x: jnp.sort(jnp.concatenate([x, -x], 0), axis=1)[:, -1],
    "concat_cols_max": lambda x: jnp.max(jnp.tanh(jnp.concatenate([x, 2 * x], 1)), 1),
    "concat_rows_argmax": lambda x: jnp.argmax(jnp.concatenate([x, x[::-1]], 0) * 3.0, 0),
    "pad_rows_argmin": lambda x: jnp.argmin(jnp.pad(x, ((2, 1), (0, 0))), 0),
    "pad_cols_top_k": lambda x: lax.top_k(jnp.pad(x, ((0, 0), (1, 2)), constant_values=1), 3),
    "stack_max": lambda x: jnp.stack([x, jnp.sin(x)], -1).max(-1),
    "stack_rows_min": lambda x: jnp.stack([x, x * 2]).min(0),
    "stack_sum": lambda x: jnp.stack([x, jnp.sin(x)], -1).sum(-1),
    "stack_unpacked": lambda x: jnp.stack([x, jnp.sin(x)])[1] * jnp.hstack([x, -x])[:, len(x.T) :],
    "nested_concat": lambda x: jnp.min(jnp.concatenate([jnp.concatenate([x, -x], 0), x], 0), 0),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(PIECES))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_pieces_give_the_whole_answer(name, data):
    """Each program, rewritten, gives jax.jit's answer bit for bit: indices and ties of the
    first piece first, NaN, inf and -0.0 as they were."""
    fun = PIECES[name]
    rows, cols = data.draw(st.integers(2, 5)), data.draw(st.integers(2, 5))
    values = data.draw(st.lists(_SPECIAL, min_size=rows * cols, max_size=rows * cols))
    x = np.asarray(values, np.float32).reshape(rows, cols)
    new, changes = _rewritten(fun, x)
    assert changes, "the pass left the program as it was"
    _same(jax.jit(lambda a: evaluate(new, [a]))(x), memsafe_jit(fun)(x))


def test_float_sums_over_the_pieces_read_them_whole():
    """A float sum or contraction over the concatenated axis is not split into pieces: in one
    reduction ``[s, -s]`` sums to exactly zero, in two it may not."""
    x = np.linspace(-3, 3, 40, dtype=np.float32).reshape(8, 5)
    for fun in (lambda x: jnp.sum(jnp.concatenate([x, -x], 0), 0),
                lambda x: jnp.ones(16) @ jnp.concatenate([x, -x], 0)):  # fmt: skip
        new, changes = _rewritten(fun, x)
        assert not changes and "concatenate" in _names(new)
    fun = lambda x: jnp.sum(jnp.concatenate([x, -x], 0).astype(jnp.int32), 0)
    new, changes = _rewritten(fun, x)
    assert any("sum" in c for c in changes)  # integer sums are exact


def test_small_concatenations_are_left_alone():
    x = np.ones((4, 3), np.float32)
    fun = PIECES["concat_rows_sort"]
    closed = inline_calls(jax.make_jaxpr(fun)(x))
    assert distribute(closed, 10**6, []) is closed


def _concat_sort(x, y):
    return jnp.sort(jnp.concatenate([x @ y.T, -(x @ y.T)], 0), axis=1)[:, -1]


def _concat_pad_matmul(x, y):
    s = jnp.concatenate([x @ y.T, -(x @ y.T)], 0)
    s = jnp.pad(jnp.sqrt(jnp.abs(s) + 1), ((0, 0), (1, 2)))
    return jnp.ones(len(s)) @ s


def _pad_argmax_sort(x, y):
    s = jnp.pad(jnp.exp(-jnp.abs(x @ y.T)), ((1, 2), (0, 0)))
    return jnp.argmax(s, 0), jnp.sort(s, 1)[:, -2]


@pytest.mark.parametrize("fun", [_concat_sort, _concat_pad_matmul, _pad_argmax_sort])
def test_programs_built_from_pieces_split_under_a_quarter(fun):
    """Each was refused before this pass at this limit (the split stopped where the axis
    changed length); now they run under a quarter of jax.jit's temporaries with jax.jit's
    answers (the matmul over the concatenated rows reads them whole, and splits the columns)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((128, 8)).astype(np.float32)
    y = rng.standard_normal((1024, 8)).astype(np.float32)
    x[5, 2] = np.inf
    limit = limit_between(fun, (x, y), 1 / 4)
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(x, y)
    assert plan.splits and plan.after.total <= limit, plan
    assert any(r.pass_name == "distribute" for r in plan.passes)
    for got, want in zip(jax.tree.leaves(f(x, y)), jax.tree.leaves(memsafe_jit(fun)(x, y))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, equal_nan=True)
