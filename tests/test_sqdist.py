"""The squared-distance rewrite (memsafe.rules.sqdist) gives jax.jit's answer: NaN and infinities
exactly, finite values and gradients within the accuracy rule (docs/accuracy.md), also for
non-finite, huge and nearly coincident inputs (issue 11, defects 1 and 2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memsafe
from memsafe.rewrite.algebraic import rewritten
from memsafe.rules.sqdist import sqdist
from memsafe.xla import memsafe_jit
from tests.agree import assert_like_jit
from tests.budget import examples
from tests.fuzz.accuracy import check


def naive(x, y):
    return jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)


def _value_and_vjp(f):
    """f(x, y) and its VJP at cotangent g, compiled as memsafe compiles (YNNPACK off)."""
    return memsafe_jit(lambda x, y, g: (f(x, y), *jax.vjp(f, x, y)[1](g)))


def _float64(f, *args):
    with jax.enable_x64():
        return _value_and_vjp(f)(*(np.asarray(a, np.float64) for a in args))


def assert_as_jit(x, y, g):
    """sqdist's value and gradients obey the accuracy rule against the direct form."""
    got = _value_and_vjp(sqdist)(x, y, g)
    want = _value_and_vjp(naive)(x, y, g)
    assert check(got, want, _float64(naive, x, y, g)) == []


@st.composite
def hard_inputs(draw):
    """Point clouds offset and scaled, with near-duplicates, NaN, +-inf and huge outliers (each
    huge value distinct by >= 2.5e19, so two outliers never nearly coincide: see the
    limitation in memsafe.rules.sqdist), and a cotangent with zeros, signs and NaN."""
    n, m, d = draw(st.integers(1, 12)), draw(st.integers(1, 12)), draw(st.integers(1, 9))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    offset = draw(st.sampled_from([0.0, 100.0, -3e4, 1e6]))
    scale = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    x = rng.standard_normal((n, d)) * scale + offset
    y = rng.standard_normal((m, d)) * scale + offset
    dup = rng.random(m) < 0.5
    y[dup] = x[rng.integers(0, n, dup.sum())] + rng.standard_normal((dup.sum(), d)) * scale * 1e-3
    x, y = x.astype(np.float32), y.astype(np.float32)
    special = draw(st.sampled_from(["none", "nonfinite", "huge", "both"]))
    count = 0
    for a in (x, y):
        for kind in ("nonfinite", "huge"):
            if special not in (kind, "both"):
                continue
            mask = rng.random(a.shape) < draw(st.sampled_from([0.05, 0.3]))
            k = int(mask.sum())
            if kind == "nonfinite":
                a[mask] = rng.choice(np.array([np.inf, -np.inf, np.nan], np.float32), k)
            else:
                a[mask] = rng.choice([-1, 1], k) * 1e20 * (1 + 0.25 * np.arange(count, count + k))
                count += k
    g = rng.standard_normal((n, m)).astype(np.float32)
    g[rng.random((n, m)) < 0.3] = 0.0
    g[rng.random((n, m)) < draw(st.sampled_from([0.0, 0.05]))] = np.nan
    return x, y, g


@settings(max_examples=examples(30))
@given(hard_inputs())
def test_sqdist_matches_the_direct_form(args):
    assert_as_jit(*args)


def _kernel_min(x, y):
    return jnp.min(jnp.exp(-jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)), axis=1)


def _points(n, m, d, seed=0):
    kx, ky = jax.random.split(jax.random.PRNGKey(seed))
    return jax.random.normal(kx, (n, d)), jax.random.normal(ky, (m, d))


def test_an_infinite_coordinate_is_an_infinite_distance():
    """Issue 11, defect 1: |x|^2 + |y|^2 - 2xy made inf - inf = NaN of an infinite distance."""
    x, y = _points(2000, 500, 8)
    x = x.at[5, 0].set(jnp.inf)
    f = memsafe.jit(_kernel_min, memory_limit="1MiB")
    assert f.plan(x, y).rules  # the rewrite fired
    assert_like_jit(f(x, y), _kernel_min, x, y)
    assert float(f(x, y)[5]) == 0.0


#: Rows of 3 coordinates, each kind of pair sqdist treats apart: finite (one with an exact zero
#: after centring is likely: 0.0 sits at the median), huge (its squared norm overflows the frame
#: of ordinary rows), +inf and -inf at the same or other coordinates, both signs in one row, NaN.
SPECIAL_ROWS = np.array(
    [
        [0.0, 0.0, 0.0],
        [1.0, -2.0, 0.5],
        [1e20, -1e20, 1.0],
        [np.inf, 0.0, 1.0],
        [np.inf, np.inf, 0.0],
        [-np.inf, 0.0, 1.0],
        [np.inf, -np.inf, 2.0],
        [0.0, np.inf, -np.inf],
        [np.nan, 0.0, 1.0],
        [np.nan, np.inf, 0.0],
    ],
    np.float32,
)


def test_every_pair_of_special_rows_is_the_direct_forms():
    """Each pair of rows above, either way round: NaN and infinities where the direct form has
    them (a finite row against an infinite one is +inf though their product is NaN; two
    infinite rows are NaN exactly where they share a signed infinity; a huge row against a
    frame it overflows is +inf), finite values close."""
    x = np.concatenate([SPECIAL_ROWS, np.full((4, 3), 0.25, np.float32)])
    ordinary = np.delete(SPECIAL_ROWS, 2, axis=0)  # the huge row overflows this frame
    for a, b in ((x, SPECIAL_ROWS), (SPECIAL_ROWS, x), (ordinary, SPECIAL_ROWS)):
        got = np.asarray(memsafe_jit(sqdist)(a, b))
        want = np.asarray(memsafe_jit(naive)(a, b))
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want))
        finite = np.isfinite(want)
        np.testing.assert_allclose(got[finite], want[finite], rtol=1e-5, atol=1e-6)


def test_a_nan_row_ranks_as_jax_jits_nan():
    """top_k orders NaN by its sign bit: the distance to a row holding a NaN is the direct
    form's NaN (sign clear), which ``-d2`` puts last, not an arithmetic's default NaN (sign set
    on x86), which it would put first."""
    x, y = _points(500, 2000, 8, seed=2)
    y = y.at[17, 2].set(jnp.nan)
    got = np.asarray(memsafe_jit(sqdist)(x, y))
    assert np.isnan(got[:, 17]).all() and not np.signbit(got[:, 17]).any()

    def knn(x, y):
        return jax.lax.top_k(-jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1), 5)[1]

    f = memsafe.jit(knn, memory_limit="1MiB")
    assert f.plan(x, y).rules
    np.testing.assert_array_equal(f(x, y), memsafe_jit(knn)(x, y))


def test_an_infinite_point_is_nobodys_nearest_neighbour():
    x, y = _points(500, 2000, 8, seed=1)
    y = y.at[7, 3].set(-jnp.inf)

    def knn(x, y):
        return jax.lax.top_k(-jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1), 4)[1]

    f = memsafe.jit(knn, memory_limit="1MiB")
    assert f.plan(x, y).rules
    got = np.asarray(f(x, y))
    assert not (got == 7).any()
    np.testing.assert_array_equal(got, memsafe_jit(knn)(x, y))


def test_gradients_with_an_infinite_input_have_jax_jits_nans():
    """The gradient was NaN at 2,292 places of y (jax.jit: 500), at any limit."""
    x, y = _points(2000, 500, 8)
    x = x.at[5, 0].set(jnp.inf)

    def loss(x, y):
        return jnp.sum(_kernel_min(x, y))

    want = memsafe_jit(jax.grad(loss, argnums=(0, 1)))(x, y)
    for limit in ("1MiB", "1GiB"):
        got = jax.grad(memsafe.jit(loss, memory_limit=limit), argnums=(0, 1))(x, y)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))


def test_near_duplicates_far_from_the_origin():
    """Issue 11, defect 2: points offset by +100 and 1e-3 apart gave -0.0 (jax.jit: 3.2e-5)."""
    x, y = _points(300, 300, 8, seed=2)
    x = x + 100.0
    y = x + 1e-3 * y
    f = rewritten(naive)
    assert f.plan(x, y).rules
    got = f(x, y)
    # uncentred, most were 0; centred, 297 to 300 of the 300 are positive (this CPU's XLA build
    # or another), and the accuracy rule below holds them to jax.jit's error
    assert (np.asarray(jnp.diagonal(got)) > 0).mean() > 0.95
    assert_like_jit(got, naive, x, y)


def _sin_topk(x, y):
    a = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)
    return jnp.sum(jax.lax.top_k(jnp.sin(a) * a, 5)[0])


def test_a_gradient_that_fits_is_the_original_gradient():
    """A rewrite needed only for memory must not change a backward program that fits."""
    x, y = _points(200, 300, 8, seed=3)
    f = memsafe.jit(_sin_topk, memory_limit="1GiB")
    got = jax.grad(f, argnums=(0, 1))(x, y)
    back = f.backward_plan(x, y)
    assert back.fits_unchanged and not back.rules
    want = memsafe_jit(jax.grad(_sin_topk, argnums=(0, 1)))(x, y)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


def test_rewritten_gradient_is_as_accurate_as_jax_jits():
    """Issue 11, defect 2: through sin(a) * a and top_k the gradient's error was 28x (x) and
    450x (y) jax.jit's against float64; under a limit that needs the rewrite it obeys the rule."""
    x, y = _points(200, 3000, 8, seed=4)
    x, y = x + 3.0, y + 3.0
    f = memsafe.jit(_sin_topk, memory_limit="1MiB")
    got = jax.grad(f, argnums=(0, 1))(x, y)
    assert f.backward_plan(x, y).rules
    grad = jax.grad(_sin_topk, argnums=(0, 1))
    with jax.enable_x64():
        ref = memsafe_jit(grad)(*(np.asarray(a, np.float64) for a in (x, y)))
    assert check(got, memsafe_jit(grad)(x, y), ref) == []


def test_a_huge_row_does_not_move_the_centre_away_from_the_others():
    """Found by the property test: of 2 rows, one at 1e20, the median's midpoint put the other
    5e19 from the centre, and its distance (8.8e-6) lost every digit. Huge values are left out
    of the centre."""
    x = np.array([[1e20], [-2.555665e-03]], np.float32)
    y = np.array([[0.0004181]], np.float32)
    g = np.array([[-0.8652131], [3.3229995]], np.float32)
    assert_as_jit(x, y, g)


@pytest.mark.xfail(strict=True, reason="known limit (memsafe.rules.sqdist): not fixed")
def test_values_near_the_largest_float_leave_ordinary_distances():
    """A value of x near float32's largest scales the frame down by 2**-69, so the squares of
    ordinary distances underflow (0 where jax.jit gives about 33). An exact path (a ``cond`` to
    the direct form, one feature at a time) was measured: the ``cond``'s result can neither be
    overwritten in place nor fused with what reads it, and the broadcast kNN's footprint went
    from 103 to 231 MiB, so it was not kept. Strict: this fails once the limit is lifted."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    y = rng.standard_normal((7, 8)).astype(np.float32)
    x[0, 0] = 3e38
    got = np.asarray(memsafe_jit(sqdist)(x, y))[1:]
    want = np.asarray(memsafe_jit(naive)(x, y))[1:]
    np.testing.assert_allclose(got, want, rtol=1e-5)
