"""The tie pass: a buffer made from no data (a loop's zeros, a scatter's target) is made after the
other operands of the loop or update that holds it, so that XLA's CPU buffer assignment, which
orders values by their data dependencies, lets it share memory with what died before.

Each footprint is XLA's ``memory_analysis``; each answer is compared bit for bit with the
program before the pass (the pass changes no value) and with jax.jit by the project's rule.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe.context import PassContext
from memsafe.passes import PIPELINE, tie
from memsafe.plan import Plan
from memsafe.xla import Footprint, memsafe_jit
from tests.agree import assert_like_jit

N, E = 1686, 6130


def _rounds(k: int, fill: float = 0.0, dtype=jnp.float32, combine=None):
    """``k`` rounds of message passing, each summing (or ``combine``-ing) its messages into a
    buffer from ``jnp.full(fill)`` in a ``fori_loop`` over pairs of edges."""
    combine = combine or (lambda acc, j, v: acc.at[j].add(v))

    def f(x, idx):
        h = x
        for _ in range(k):
            acc0 = jnp.full((N, 32), fill, dtype)

            def body(i, acc, h=h):
                j = lax.dynamic_slice_in_dim(idx, i * 2, 2)
                v = jnp.tanh(h[j] @ jnp.ones((8, 32))).astype(dtype)
                return combine(acc, j, v)

            acc = lax.fori_loop(0, E // 2, body, acc0)
            acc = jnp.where(jnp.isfinite(acc), acc, 0).astype(x.dtype)
            h = h + jnp.tanh(acc @ jnp.ones((32, 8)))
        return h

    return f


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(N, 8)), jnp.float32)
    idx = jnp.asarray(rng.integers(0, N, E), jnp.int32)
    return x, idx


def _temps(f, *args) -> int:
    return Footprint.from_compiled(memsafe_jit(f).lower(*args).compile()).temps


def _tied(f, *args):
    closed = jax.make_jaxpr(f)(*args)
    ctx = PassContext(1 << 40, 0, Plan(1 << 40))
    new = tie.run(closed, ctx)
    return closed, new, ctx


def _fun(closed):
    return lambda *a: jax.core.eval_jaxpr(closed.jaxpr, closed.consts, *a)


def test_the_pass_runs_last_in_the_pipeline():
    assert PIPELINE[-1] is tie


def test_rounds_of_loop_accumulators_share_one_buffer_once_tied():
    args = _inputs()
    f = _rounds(6)
    closed, new, ctx = _tied(f, *args)
    assert new is not closed
    (record,) = ctx.plan.records
    assert record.pass_name == "tie" and record.description.startswith("5 buffers")
    before, after = _temps(_fun(closed), *args), _temps(_fun(new), *args)
    # one float32[1686, 32] buffer per round before (6 x 216 KiB), two or three after
    assert before > 6 * N * 32 * 4
    assert after < 3 * N * 32 * 4
    got = jax.jit(_fun(new))(*args)
    want = jax.jit(_fun(closed))(*args)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))


@pytest.mark.parametrize("fill", [-0.0, -np.inf, np.nan, 3.5])
def test_the_fill_is_the_same_bit_for_bit(fill):
    """``fill - |0|`` is ``fill`` for -0.0, inf and NaN too; a running max from -inf."""
    args = _inputs(1)
    f = _rounds(2, fill, combine=lambda acc, j, v: acc.at[j].max(v))
    closed, new, _ = _tied(f, *args)
    assert new is not closed
    inits_before = [e for e in closed.jaxpr.eqns if e.primitive.name == "broadcast_in_dim"]
    assert inits_before
    got = jax.jit(_fun(new))(*args)[0]
    want = jax.jit(_fun(closed))(*args)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # the tied fill itself, as its bits
    def init_only(x, idx):
        return lax.fori_loop(0, 1, lambda i, a: a, jnp.full((N, 32), fill, jnp.float32)), x + 1

    c, n, _ = _tied(init_only, *args)
    bits = lambda v: np.asarray(v).view(np.uint32)
    np.testing.assert_array_equal(bits(_fun(n)(*args)[0]), bits(_fun(c)(*args)[0]))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bfloat16])
def test_integer_and_narrow_float_buffers(dtype):
    args = _inputs(2)
    f = _rounds(3, 0, dtype=dtype)
    closed, new, ctx = _tied(f, *args)
    assert ctx.plan.records
    np.testing.assert_array_equal(
        np.asarray(jax.jit(_fun(new))(*args)[0]), np.asarray(jax.jit(_fun(closed))(*args)[0])
    )
    assert _temps(_fun(new), *args) < _temps(_fun(closed), *args)


def test_a_program_without_such_buffers_is_left_as_it_is():
    f = lambda x, y: jnp.sum(jnp.exp(x @ y.T), axis=1)
    x = jnp.ones((64, 8))
    closed, new, ctx = _tied(f, x, x)
    assert new is closed and not ctx.plan.records


def test_buffers_inside_a_loop_body_are_tied_to_the_body_values():
    args = _inputs(3)
    inner = _rounds(3)

    def f(x, idx):
        return lax.fori_loop(0, 2, lambda i, h: inner(h, idx), x)

    closed, new, ctx = _tied(f, *args)
    assert ctx.plan.records and new is not closed
    np.testing.assert_array_equal(
        np.asarray(jax.jit(_fun(new))(*args)[0]), np.asarray(jax.jit(_fun(closed))(*args)[0])
    )


def test_memsafe_fits_the_rounds_under_a_third_of_jax_jit_temporaries():
    args = _inputs(4)
    f = _rounds(6)
    plain = Footprint.from_compiled(memsafe_jit(f).lower(*args).compile())
    limit = plain.arguments + plain.outputs + plain.temps // 3
    g = memsafe.jit(f, memory_limit=limit)
    got = g(*args)
    plan = g.plan(*args)
    assert plan.after.total <= limit
    assert any(getattr(r, "pass_name", "") == "tie" for r in plan.records)
    assert_like_jit(got, f, *args)


def _stacking(k: int, reverse: bool):
    """``k`` rounds, each a ``lax.scan`` over the rows whose stacked outputs the next reads."""

    def f(x):
        h = x
        for _ in range(k):

            def body(c, row):
                y = jnp.tanh(row @ jnp.ones((8, 32)))
                return c + y[0], (y, c)

            _, (ys, cs) = lax.scan(body, 0.0, h, reverse=reverse)
            h = h + jnp.tanh(ys @ jnp.ones((32, 8))) + cs[:, None]
        return h

    return f


@pytest.mark.parametrize("reverse", [False, True])
def test_a_scans_stacked_outputs_are_carried_buffers_made_after_its_operands(reverse):
    """XLA lowers a scan's stacked outputs into buffers made from no data: six rounds held one
    per round. Carried and written row by row, made after the scan's operand, they share."""
    x = _inputs(5)[0]
    f = _stacking(6, reverse)
    closed, new, ctx = _tied(f, x)
    (record,) = ctx.plan.records
    # both stacked outputs of every round but the first (which reads the input alone)
    assert record.description.startswith("10 buffers")
    assert "float32[1686, 32] stacked by scan" in record.description
    before, after = _temps(_fun(closed), x), _temps(_fun(new), x)
    assert before > 6 * N * 32 * 4
    assert after < 3 * N * 32 * 4
    np.testing.assert_array_equal(
        np.asarray(jax.jit(_fun(new))(x)[0]), np.asarray(jax.jit(_fun(closed))(x)[0])
    )


@pytest.mark.parametrize(
    "reverse, unroll, with_xs", [(False, 1, True), (True, 2, True), (False, 3, False)]
)
def test_a_converted_scan_keeps_every_output(reverse, unroll, with_xs):
    """Carries, small and large stacked outputs, integer ones, a length-only scan: the same
    values after the conversion, bit for bit."""
    rng = np.random.default_rng(7)
    x = jnp.asarray(rng.normal(size=(300, 16)), jnp.float32)

    def f(x):
        h = jnp.tanh(x) * 2  # made in the program: a dependency worth tying to

        def body(c, row):
            s, n = c
            row = h[n % 300] if row is None else row
            y = jnp.sin(row) * s
            return (s + jnp.sum(y), n + 1), (y, s, (row * 7).astype(jnp.int32), y[:2])

        xs = h if with_xs else None
        (s, n), ys = lax.scan(
            body, (jnp.float32(1), jnp.int32(0)), xs, length=300, reverse=reverse, unroll=unroll
        )
        return s, n, *ys

    closed, new, ctx = _tied(f, x)
    assert "stacked by scan" in ctx.plan.records[0].description
    got, want = jax.jit(_fun(new))(x), jax.jit(_fun(closed))(x)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
