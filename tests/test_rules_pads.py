"""The sum of zero pads as one buffer written in place (``memsafe.rules.pads``): the gradient of a
stacked parameter read a slice per layer in a Python loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

from memsafe.graph import inline_calls
from memsafe.rewrite.match import apply_matches
from memsafe.rules import pads
from memsafe.xla import Footprint, memsafe_jit
from tests.budget import examples
from tests.limits import plan_fitting


def _rewritten(fun, *args):
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    found = pads.find_rewrites(closed)  # every chain, whatever the room
    new, records = apply_matches(closed, [], found), [r.record for r in found]
    run = memsafe_jit(lambda *xs: _one(jax.core.eval_jaxpr(new.jaxpr, new.consts, *xs)))
    return new, records, run


def _one(outs):
    return outs[0] if len(outs) == 1 else outs


def _same_bits(got, want):
    """Equal values, NaNs in the same places and zeros of the same sign."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    ok = ~np.isnan(want)
    np.testing.assert_array_equal(got[ok], want[ok])
    np.testing.assert_array_equal(np.signbit(got[ok]), np.signbit(want[ok]))


def _layers(p, x):
    """Layers read from stacks one slice each, in a Python loop."""
    h = x
    for i in range(p["w"].shape[0]):
        h = h + jax.nn.relu(h @ p["w"][i] + p["b"][i])
    return jnp.sum(h**2)


def _adam(p, m, u, x):
    """An Adam-like step: the gradient is read twice (both moments), so XLA stores it."""
    g = jax.grad(_layers)(p, x)
    m = jax.tree.map(lambda a, b: 0.9 * a + 0.1 * b, m, g)
    u = jax.tree.map(lambda a, b: 0.99 * a + 0.01 * b * b, u, g)
    new = jax.tree.map(lambda q, a, b: q - 0.05 * a / (jnp.sqrt(b) + 1e-3), p, m, u)
    return new, m, u


def _sgd(p, x):
    """An SGD step: the gradient is read once, elementwise."""
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, jax.grad(_layers)(p, x))


def _stack(depth=4, width=256, rows=128):
    k1, k2 = jax.random.split(jax.random.key(0))
    p = {
        "w": jax.random.normal(k1, (depth, width, width)) / width**0.5,
        "b": jnp.zeros((depth, width)),
    }
    u = jax.tree.map(lambda a: jnp.abs(a) * 1e-3 + 1e-4, p)
    return p, u, jax.random.normal(k2, (rows, width))


def _flat(fun, *args):
    leaves, tree = jax.tree.flatten(args)
    return (lambda *xs: fun(*jax.tree.unflatten(tree, xs))), leaves


def _temps(jitted, *args):
    return Footprint.from_compiled(jitted.lower(*args).compile()).temps


def test_a_stored_gradient_of_a_stack_read_per_layer_is_written_in_place():
    """Each pad the stored gradient sums (weights and biases) becomes an update of its slice:
    jax.jit's answers bit for bit, and a stack less of temporaries than jax.jit's."""
    p, u, x = _stack()
    fun, args = _flat(_adam, p, p, u, x)
    new, records, run = _rewritten(fun, *args)
    assert [r.rule for r in records] == [pads.NAME] * 2 * (p["w"].shape[0] - 1)
    names = [e.primitive.name for e in new.jaxpr.eqns]
    assert names.count("dynamic_update_slice") == 6 and names.count("pad") == 2
    for got, want in zip(run(*args), jax.tree.leaves(memsafe_jit(fun)(*args))):
        _same_bits(got, want)
    assert _temps(run, *args) <= _temps(memsafe_jit(fun), *args) - p["w"].nbytes


def test_a_gradient_read_once_elementwise_keeps_its_pads():
    """XLA fuses the pads into the one elementwise reader and never stores the stack."""
    p, _, x = _stack()
    fun, args = _flat(_sgd, p, x)
    assert _rewritten(fun, *args)[1] == []


def test_a_deep_training_step_of_a_stack_fits_a_quarter_of_jax_jits_temporaries():
    """Sixteen layers: XLA holds a partial sum of the gradient's pads per layer (temporaries
    many stacks large); written in place, the step fits a quarter of jax.jit's temporaries with
    jax.jit's answers (without the rewrite memsafe refused such steps: at 32 layers of 512 x 512
    its best was 1.2 GiB against a 454 MB limit, after 386 s of planning)."""
    p, u, x = _stack(depth=16, width=128, rows=32)
    plan = plan_fitting(_adam, [p, p, u, x], 0.25)
    assert pads.NAME in {r.rule for r in plan.rules}


def test_zeros_keep_their_signs_and_nans_stay():
    """-0.0 in every piece, NaN and inf: the sum of pads gives +0.0 wherever a piece's -0.0 met
    another pad's zeros; the updates give the same."""

    def fun(a, b, c):
        return (
            jnp.pad(a, ((0, 3), (0, 0)))
            + jnp.pad(b, ((1, 1), (0, 0)))
            + jnp.pad(c, ((3, 0), (0, 0)))
        )

    a = jnp.array([[-0.0, 1.0, jnp.nan]])
    b = jnp.array([[-0.0, -jnp.inf, -0.0], [2.0, -0.0, 0.0]])
    c = jnp.array([[-0.0, -0.0, jnp.inf]])
    _, records, run = _rewritten(fun, a, b, c)
    assert len(records) == 2
    _same_bits(run(a, b, c), memsafe_jit(fun)(a, b, c))
    got = np.asarray(run(a, b, c))
    assert not (np.signbit(got) & (got == 0)).any()


def test_overlapping_first_pieces_and_other_values_stop_the_chain():
    """Two first pieces that overlap (where -0.0 + -0.0 stays -0.0), a sum with a value that is
    no pad (it may hold -0.0 anywhere) and pads filled with -0.0 are left as they are."""

    def overlapping(a, b):
        return jnp.pad(a, ((0, 1), (0, 0))) + jnp.pad(b, ((1, 0), (0, 0)))

    def with_other(a, y):
        return y + jnp.pad(a, ((0, 1), (0, 0)))

    def negative_zeros(a, b):
        return lax.pad(a, -0.0, ((0, 1, 0), (0, 0, 0))) + lax.pad(b, -0.0, ((1, 0, 0), (0, 0, 0)))

    a = jnp.ones((3, 2))
    assert _rewritten(overlapping, a, a)[1] == []
    assert _rewritten(negative_zeros, a[:1], a[:1])[1] == []
    assert _rewritten(with_other, a, jnp.ones((4, 2)))[1] == []


@st.composite
def _programs(draw):
    """A sum of 2-5 zero pads of random pieces of a 2-d value, along either axis or both,
    summed in a random tree order, with special values in the pieces."""
    shape = (draw(st.integers(2, 7)), draw(st.integers(2, 7)))
    n = draw(st.integers(2, 5))
    pieces = []
    for _ in range(n):
        starts = [draw(st.integers(0, d - 1)) for d in shape]
        sizes = [draw(st.integers(1, d - s)) for s, d in zip(starts, shape)]
        pieces.append((tuple(starts), tuple(sizes)))
    order = draw(st.permutations(range(n)))
    left = draw(st.booleans())  # (acc + pad) or (pad + acc)
    seed = draw(st.integers(0, 2**16))
    return shape, pieces, order, left, seed


@settings(deadline=None, max_examples=examples(60))
@given(_programs())
def test_any_sum_of_zero_pads_is_rewritten_to_the_same_bits(program):
    shape, pieces, order, left, seed = program
    rng = np.random.default_rng(seed)
    special = np.array([-0.0, 0.0, np.nan, np.inf, -np.inf, 1.0, -1.0], np.float32)
    values = [rng.choice(special, size) for _, size in pieces]

    def fun(*xs):
        padded = [
            lax.pad(x, jnp.float32(0), [(s, d - s - n, 0) for s, n, d in zip(st_, x.shape, shape)])
            for x, (st_, _) in zip(xs, pieces)
        ]
        acc = padded[order[0]]
        for k in order[1:]:
            acc = acc + padded[k] if left else padded[k] + acc
        return acc

    args = [jnp.asarray(v) for v in values]
    _, records, run = _rewritten(fun, *args)
    first, second = (pieces[k] for k in order[:2])
    apart = any(s + n <= t or t + m <= s for s, n, t, m in zip(*first, *second))
    assert bool(records) == apart
    _same_bits(run(*args), memsafe_jit(fun)(*args))


def test_integer_pads_are_rewritten_too():
    def fun(a, b):
        return jnp.pad(a, ((0, 2),)) + jnp.pad(b, ((2, 0),))

    a, b = jnp.arange(2, dtype=jnp.int32), jnp.arange(2, 4, dtype=jnp.int32)
    _, records, run = _rewritten(fun, a, b)
    assert len(records) == 1
    np.testing.assert_array_equal(run(a, b), fun(a, b))
