"""A scan split through its body whose body sums over the split axis into some of its results:
each layer's parameter gradient in the backward scan over layers (flax ``nn.scan``), a carry
accumulating a gradient or a total over the rows. Each chunk's scan gives its share, and the
shares add up (``memsafe.split.prims.loops.Summed``); a share may reach a result only through
operations linear in it (``memsafe.split.linear``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe.split import body
from memsafe.split.linear import Role, keeps_sums
from memsafe.split.registry import PLAIN, NoRule
from memsafe.xla import memsafe_jit
from tests.agree import assert_like_jit
from tests.limits import limit_between

B, D, T = 4096, 64, 4


def _layers(ws, x):
    """A stack of tanh layers as a scan over their stacked weights (ws: [T, D, D])."""

    def layer(h, w):
        return jnp.tanh(h @ w), None

    return lax.scan(layer, x, ws)[0]


def _inputs(nan: bool = True):
    rng = np.random.default_rng(0)
    ws = rng.standard_normal((T, D, D), dtype=np.float32) / 8
    x = rng.standard_normal((B, D), dtype=np.float32)
    if nan:
        x[17, 3] = np.nan
    return jnp.asarray(ws), jnp.asarray(x)


def _fits(fun, args, fraction=1 / 4):
    limit = limit_between(fun, args, fraction)
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(*args)
    assert plan.after.total <= limit, plan
    assert any("scan" in s.ops and s.axis in (0, 1) for s in plan.splits), plan
    assert_like_jit(f(*args), fun, *args)
    return plan


@pytest.mark.parametrize("wrt", [(0,), (0, 1)], ids=["weights", "weights-and-inputs"])
def test_layer_gradients_sum_over_chunks_of_the_batch(wrt):
    """The backward scan over layers sums each layer's weight gradient over the batch: split
    along the batch, each chunk gives its share of every layer's gradient (NaN row included)."""

    def fun(ws, x):
        return jax.grad(lambda ws, x: jnp.sum(_layers(ws, x) ** 2), argnums=wrt)(ws, x)

    _fits(fun, _inputs())


def test_a_shared_weight_accumulates_its_gradient_in_a_carry():
    """A weight every iteration reads (a scan constant) has its gradient accumulated in the
    backward scan's carry: that carry is a share, started from zero on later chunks."""

    def fun(w, x):
        def loss(w, x):
            def step(h, _):
                return jnp.tanh(h @ w), jnp.sum(h, 1)

            h, ys = lax.scan(step, x, None, length=T)
            return jnp.sum(h**2) + jnp.sum(ys)

        return jax.grad(loss)(w, x)

    ws, x = _inputs()
    _fits(fun, (ws[0], x))


def test_a_carry_decaying_a_total_over_the_rows():
    """A carry linear in itself and in a sum over the rows (``0.5 * c + sum(z)``) is a share:
    the later chunks' shares, started from zero, add up to the whole loop's carry."""

    def fun(ws, x):
        def step(carry, w):
            h, c = carry
            z = jnp.tanh(h[:, :, None] * w[0, :16]).reshape(len(h), -1)  # [B, 16 D]
            h = jnp.tanh(h @ w)
            return (h, 0.5 * c + jnp.sum(z, 0)), jnp.max(z, 1)

        (_, c), ys = lax.scan(step, (x, jnp.ones(16 * D)), ws)
        return c, ys

    ws, x = _inputs()
    scan = next(e for e in jax.make_jaxpr(fun)(ws, x).eqns if e.primitive.name == "scan")
    inner = scan.params["jaxpr"].jaxpr
    got = body.propagate(inner, {0: 0}, PLAIN, [(0, 0), (1, 1)], sums=True)
    assert got.result_shares(inner) == (1,) and inner.invars[1] in got.shares
    limit = limit_between(fun, (ws, x), 1 / 3)
    assert_like_jit(memsafe.jit(fun, memory_limit=limit)(ws, x), fun, ws, x)


def test_a_share_through_a_nonlinear_operation_is_refused():
    """``tanh(c + sum(z))`` is no sum of the chunks' shares: the body split is refused."""

    def fun(ws, x):
        def step(c, w):
            return jnp.tanh(c + jnp.sum(jnp.tanh(x @ w), 0)), None

        return lax.scan(step, jnp.zeros(D), ws)[0]

    ws, x = _inputs()
    scan = next(e for e in jax.make_jaxpr(fun)(ws, x).eqns if e.primitive.name == "scan")
    inner = scan.params["jaxpr"].jaxpr
    with pytest.raises(NoRule, match="not linear in a sum over the split axis"):
        body.propagate(inner, {0: 0}, PLAIN, [(1, 0)], sums=True)


def test_a_share_plus_a_value_read_whole_is_refused():
    """``sum(z) + w`` adds ``w`` once per chunk: a result that is such a sum is refused."""

    def fun(ws, x):
        def step(h, w):
            z = jnp.tanh(h @ w)
            return z, jnp.sum(z, 0) + w[0]

        return lax.scan(step, x, ws)

    ws, x = _inputs()
    scan = next(e for e in jax.make_jaxpr(fun)(ws, x).eqns if e.primitive.name == "scan")
    with pytest.raises(NoRule, match="add inside the loop body is not linear"):
        body.propagate(scan.params["jaxpr"].jaxpr, {0: 0}, PLAIN, [(0, 0)], sums=True)
    limit = limit_between(fun, (ws, x), 1 / 4)
    try:  # whatever memsafe does instead, it gives jax.jit's answer
        got = memsafe.jit(fun, memory_limit=limit)(ws, x)
    except memsafe.MemoryLimitError:
        return
    assert_like_jit(got, fun, ws, x)


def _eqn(fun, *avals):
    return jax.make_jaxpr(fun)(*avals).eqns[-1]


S, W, Z, X = Role.SHARE, Role.WHOLE, Role.ZERO, Role.SPLIT
v = jnp.ones((3, 4))


@pytest.mark.parametrize(
    "fun, roles, keeps",
    [
        (lambda a, b: a * b, (S, W), True),
        (lambda a, b: a * b, (S, S), False),
        (lambda a, b: a @ b.T, (W, S), True),
        (lambda a, b: a / b, (S, W), True),
        (lambda a, b: a / b, (W, S), False),
        (lambda a, b: a + b, (S, S), True),
        (lambda a, b: a + b, (S, W), False),
        (lambda a, b: a - b, (S, Z), True),
        (lambda a, b: a + b, (S, X), False),
        (lambda a, b: jnp.tanh(a), (S,), False),
        (lambda a, b: a.T, (S,), True),
        (lambda a, b: jnp.sum(a, 0), (S,), True),
        (lambda a, b: a.astype(jnp.int32), (S,), False),
        (lambda a, b: lax.pad(a, 0.0, [(1, 1, 0), (0, 2, 1)]), (S, Z), True),
        (lambda a, b: lax.pad(a, 1.0, [(1, 1, 0), (0, 2, 1)]), (S, W), False),
        (lambda a, b: jnp.concatenate([a, b]), (S, Z), True),
        (lambda a, b: jnp.concatenate([a, b]), (S, W), False),
    ],
)
def test_which_operations_keep_a_sum_a_sum(fun, roles, keeps):
    eqn = _eqn(fun, v, v)
    assert keeps_sums(eqn, list(roles)[: len(eqn.invars)]) is keeps


def test_select_keeps_a_sum_where_its_predicate_is_read_whole():
    eqn = _eqn(lambda p, a, z: lax.select_n(p, z, a), v > 0, v, v)
    assert keeps_sums(eqn, [W, Z, S]) and keeps_sums(eqn, [W, S, S])
    assert not keeps_sums(eqn, [S, Z, S]) and not keeps_sums(eqn, [W, W, S])


def test_answers_equal_jax_jit_with_nan_and_inf():
    """The layer gradients of a batch with NaN and inf rows, split along the batch."""
    ws, x = _inputs(nan=False)
    x = x.at[5].set(jnp.inf).at[9, 1].set(jnp.nan)

    def fun(ws, x):
        return jax.grad(lambda ws: jnp.sum(jnp.nan_to_num(_layers(ws, x))))(ws)

    limit = limit_between(fun, (ws, x), 1 / 4)
    got = memsafe.jit(fun, memory_limit=limit)(ws, x)
    want = memsafe_jit(fun)(ws, x)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    assert_like_jit(got, fun, ws, x)


def test_a_fori_loop_over_layers_gives_its_counter_from_any_chunk():
    """``fori_loop`` over layers carries its counter beside the rows: the counter reads nothing
    of the batch, every chunk's loop gives the same one, and the batch still splits (the
    weights' gradient summed over the chunks, the counter's final value taken once)."""

    def fun(ws, x):
        def loss(ws, x):
            h = lax.fori_loop(0, T, lambda i, h: jnp.tanh(h @ ws[i]), x)
            return jnp.sum(h**2)

        return jax.grad(loss, argnums=(0, 1))(ws, x)

    _fits(fun, _inputs())


def test_results_the_same_on_every_chunk_are_not_summed():
    """A carry started at 10 and a stacked output that read nothing of the rows come out once,
    not once per chunk; the rows' own results split as before."""

    def fun(ws, x):
        def step(carry, w):
            h, k = carry
            wide = jnp.tile(w, (1, 16))
            z = jnp.tanh(h @ wide)  # [B, 16 D]
            return (jnp.tanh(z @ wide.T / 16), k + jnp.sum(w)), k * 2.0

        (h, k), ks = lax.scan(step, (x, jnp.full((), 10.0, x.dtype)), ws)
        return h, k, ks

    ws, x = _inputs()
    scan = next(e for e in jax.make_jaxpr(fun)(ws, x).eqns if e.primitive.name == "scan")
    inner = scan.params["jaxpr"].jaxpr
    got = body.propagate(inner, {0: 0}, PLAIN, [(0, 0), (1, 1)], sums=True)
    assert inner.outvars[1] not in got.axes and not got.result_shares(inner)
    limit = limit_between(fun, (ws, x), 1 / 4)
    f = memsafe.jit(fun, memory_limit=limit)
    assert f.plan(ws, x).splits
    assert_like_jit(f(ws, x), fun, ws, x)


def test_a_call_result_without_the_axis_is_refused():
    """Only loops take such results from a chunk: a call's body must give each result the
    axis (the calls the pipeline meets are a split's own chunk calls)."""

    def fun(x):
        return x * 2.0, jnp.float32(3.0)

    x = jnp.ones((8, 4))
    inner = jax.make_jaxpr(fun)(x).jaxpr
    with pytest.raises(NoRule, match="does not carry the split axis"):
        body.propagate(inner, {0: 0}, PLAIN)


def test_a_costly_result_the_same_on_every_chunk_is_refused():
    """A result without the rows' axis that only heavy work gives (a product of a weight read
    whole) would be computed again by every chunk: the body split is refused."""
    big = jnp.ones((256, 256))

    def fun(ws, x):
        def step(carry, w):
            h, acc = carry
            return (jnp.tanh(h @ w), acc + jnp.tanh(big @ big)), None

        return lax.scan(step, (x, jnp.zeros_like(big)), ws)[0]

    ws, x = _inputs()
    scan = next(e for e in jax.make_jaxpr(fun)(ws, x).eqns if e.primitive.name == "scan")
    inner = scan.params["jaxpr"].jaxpr
    n_consts = scan.params["num_consts"]
    tied = [(n_consts, 0), (n_consts + 1, 1)]
    with pytest.raises(NoRule, match="each chunk would compute it again"):
        body.propagate(inner, {n_consts: 0}, PLAIN, tied, sums=True)


def test_a_dead_summed_carry_still_starts_later_chunks_from_zero():
    """Fuzz seed 2548: the gradient of a scan whose carry totals its rows, split along the
    other set's rows. The backward's carry cotangent is a share added to each iteration's
    cotangent of its rows, and nothing reads it after the loop; it must still start each later
    chunk from zero, or the chunks count it once each (the gradient was 7 where jax.jit's is
    1)."""
    rng = np.random.default_rng(2548)
    x = jnp.asarray(rng.standard_normal((64, 6), dtype=np.float32))
    y = jnp.asarray(rng.standard_normal((2000, 6), dtype=np.float32))

    def loss(x, y):
        def step(c, a):
            return c + jnp.sum(a), jnp.outer(a[:, 0], y[:, 0])[:2]

        total, ys = lax.scan(step, jnp.zeros(()), x.reshape(4, -1, 6))
        return total + jnp.sum(ys)

    fun = jax.grad(loss, argnums=(0, 1))
    limit = limit_between(fun, (x, y), 1 / 3)
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(x, y)
    assert any("scan" in s.ops for s in plan.splits), plan
    assert_like_jit(f(x, y), fun, x, y)
