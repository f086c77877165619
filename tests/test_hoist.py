"""The hoist pass: a slice, reversal or dynamic slice of a large computed value runs above the
operations computing it, with jax.jit's answers bit for bit (ties, NaN and inf included);
programs whose large value was reversed or dynamically sliced along the axis they split on now
split under a limit (both were refused before the pass)."""

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
from memsafe.passes.hoist import hoist
from memsafe.xla import memsafe_jit
from tests.limits import limit_between


def _hoisted(fun, *args, large=0):
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    changes: list[str] = []
    return closed, hoist(closed, large, changes), changes


def _names(closed):
    return [e.primitive.name for e in closed.jaxpr.eqns]


#: Values from a small set, so ties are common; NaN and infinities among them.
_SPECIAL = st.sampled_from([0.0, -0.0, 1.0, 2.0, -1.0, np.inf, -np.inf, np.nan])

#: Windows of computed values along one axis, each above operations pointwise along it.
WINDOWS = {
    "rev_rows_of_tanh": lambda x, y, i: jnp.flip(jnp.tanh(x * 2.0), 0),
    "rev_cols_of_outer": lambda x, y, i: jnp.flip(jnp.outer(x[:, 0], y[:, 1]), 1),
    "strided_rows_of_product": lambda x, y, i: (x @ y.T)[1::2] + 1.0,
    "offset_cols_of_max": lambda x, y, i: jnp.max(x[:, None, :] - y[None], -1)[:, 2:-1],
    "dynamic_rows_of_sum": lambda x, y, i: lax.dynamic_slice_in_dim(
        jnp.sum(jnp.exp(x[:, None, :] * y[None]), -1), i, 5, 0
    ),
    "dynamic_cols_through_transpose": lambda x, y, i: lax.dynamic_slice_in_dim(
        (y @ x.T).T, i, 4, 1
    ),
    "rev_of_argmax_input": lambda x, y, i: jnp.argmax(jnp.flip(jnp.abs(x @ y.T), 1), 1),
    "dynamic_cols_of_stack_sum": lambda x, y, i: lax.dynamic_slice_in_dim(
        jnp.stack([x @ y.T, jnp.sin(x @ y.T)], -1).sum(-1), i, 5, 1
    ),
    "strided_rows_of_cumsum": lambda x, y, i: jnp.cumsum(x * y, 1)[::3],
    "rev_of_batched_product": lambda x, y, i: jnp.flip(
        jnp.einsum(
            "bij,bkj->bik", jnp.broadcast_to(x, (3, 8, 6)) * jnp.arange(3.0)[:, None, None], y[None]
        ),
        0,
    ),
}


@pytest.mark.parametrize("name", sorted(WINDOWS))
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_moved_window_gives_the_same_values(name, data):
    """Rewritten, each program reads its window before computing, and equals the original."""
    fun = WINDOWS[name]
    x = np.array(data.draw(st.lists(_SPECIAL, min_size=48, max_size=48)), np.float32)
    y = np.array(data.draw(st.lists(_SPECIAL, min_size=48, max_size=48)), np.float32)
    i = np.int32(data.draw(st.integers(-2, 9)))
    args = (x.reshape(8, 6), y.reshape(8, 6), i)
    # values over 100 bytes move; the columns the outer product reads (32 bytes) take the window
    closed, new, changes = _hoisted(fun, *args, large=100)
    assert changes and new is not closed
    got = evaluate(new, args)
    want = jax.jit(fun)(*args)
    for g, w in zip(got, jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_window_moves_to_the_arguments():
    """``flip(x @ y.T, 0)`` becomes ``flip(x, 0) @ y.T``: the reversal is on the argument."""
    x, y = jnp.ones((8, 3)), jnp.ones((5, 3))
    _, new, changes = _hoisted(lambda x, y: jnp.flip(x @ y.T, 0), x, y)
    assert _names(new).index("rev") < _names(new).index("dot_general")
    assert changes == ["rev along axis 0 computed before dot_general"]


def test_a_value_read_twice_inside_the_cone_moves_once():
    """``s`` is read by ``sin`` and by the stack, both moved: the slice lands on the arguments."""
    x, y = jnp.ones((8, 3)), jnp.ones((5, 3))

    def f(x, y):
        s = jnp.outer(x[:, 0], y[:, 0])
        return jnp.stack([s, jnp.sin(s)], -1).sum(-1)[:, 1:]

    _, new, changes = _hoisted(f, x, y, large=100)
    assert changes == ["slice along axis 1 computed before reduce_sum"]
    assert _names(new).count("mul") == 1  # the outer product, computed once, already sliced
    np.testing.assert_array_equal(evaluate(new, (x, y))[0], f(x, y))


def test_value_used_twice_or_small_keeps_its_window():
    """A value with another use would be computed twice, and a window left on it would stop a
    split as before; a small value fits as it is."""
    x, y = jnp.ones((8, 3)), jnp.ones((5, 3))

    def twice(x, y):
        s = x @ y.T
        return jnp.flip(s, 0), s

    closed, new, changes = _hoisted(twice, x, y)
    assert new is closed and not changes
    closed, new, changes = _hoisted(lambda x, y: jnp.flip(x @ y.T, 0), x, y, large=1 << 20)
    assert new is closed and not changes


def test_windows_along_two_axes_or_of_a_scan_along_the_axis_stay():
    """A window along two axes, or of a cumulative sum along its axis, is not moved."""
    x = jnp.ones((8, 3))
    _, _, changes = _hoisted(lambda x: jnp.flip(jnp.tanh(x)), x)
    assert not changes
    _, _, changes = _hoisted(lambda x: jnp.cumsum(x * 2.0, 0)[2:], x)
    assert not changes
    _, _, changes = _hoisted(lambda x: jnp.cumsum(x * 2.0, 1)[2:], x)
    assert changes == ["slice along axis 0 computed before cumsum"]


def test_window_that_would_stay_on_a_large_computed_value_is_not_moved():
    """Moved above ``tanh``, the reversal would sit on ``d``, large and used twice: the pass
    leaves the program as it is (fuzz seed 258: a max's gradient split with a reversed operand
    recomputed per stage lost its ties)."""
    x = jnp.ones((8, 3))

    def shared(x):
        d = x * 2.0
        return jnp.flip(jnp.tanh(d), 0), jnp.sum(d)

    closed, new, changes = _hoisted(shared, x)
    assert new is closed and not changes


#: Rows of a product reversed or dynamically sliced, then sorted along the other axis: the only
#: split is along the rows, through the window. Refused before the pass ("no rule to split
#: through dot_general, rev" and "... dynamic_slice").
SORTED_ROWS = {
    "flipped": lambda x, y, i: jnp.sort(jnp.flip(x @ y.T, 0) * 2.0, 1)[:, -3:],
    "dynamic": lambda x, y, i: jnp.sort(lax.dynamic_slice_in_dim(x @ y.T, i, 700, 0), 1)[:, -3:],
}


@pytest.mark.parametrize("name", sorted(SORTED_ROWS))
def test_rows_read_through_a_window_split(name):
    fun = SORTED_ROWS[name]
    kx, ky = jax.random.split(jax.random.key(0))
    # small integers: every product is exact, whatever the shape of the matmul that computes it
    x = jnp.round(jax.random.normal(kx, (1000, 8)) * 2)
    y = jnp.round(jax.random.normal(ky, (600, 8)) * 2)
    args = (x, y, 123)
    limit = limit_between(fun, args, 0.25)
    safe = memsafe.jit(fun, memory_limit=limit)
    np.testing.assert_array_equal(safe(*args), memsafe_jit(fun)(*args))
    plan = safe.plan(*args)
    assert plan.splits and plan.after.total <= limit
    assert any(r.pass_name == "hoist" for r in plan.records if hasattr(r, "pass_name"))
