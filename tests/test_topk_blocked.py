"""The block-maxima top_k used for split top_k sinks equals lax.top_k bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax import lax

import memsafe
from memsafe.split.topk import block_size, top_k

SPECIALS = np.array([0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, 1.0, -1.0], np.float32)


def _assert_same(a, b) -> None:
    (va, ia), (vb, ib) = a, b
    np.testing.assert_array_equal(np.asarray(ia), np.asarray(ib))
    assert np.asarray(va).tobytes() == np.asarray(vb).tobytes()  # signed zeros and NaNs too


@given(
    rows=st.integers(1, 4),
    size=st.integers(64, 3000),
    k=st.integers(1, 24),
    kind=st.sampled_from(["normal", "ties", "specials", "int"]),
    axis_first=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_blocked_top_k_equals_lax(rows, size, k, kind, axis_first, seed):
    rng = np.random.default_rng(seed)
    shape = (rows, size)
    if kind == "normal":
        x = rng.standard_normal(shape).astype(np.float32)
    elif kind == "ties":
        x = rng.integers(-3, 3, shape).astype(np.float32)
    elif kind == "specials":
        x = rng.choice(SPECIALS, shape)
    else:
        x = rng.integers(-5, 5, shape).astype(np.int32)
    k = min(k, size)
    axis = 0 if axis_first else 1
    x = jnp.asarray(x.T if axis_first else x)
    expect = lax.top_k(jnp.moveaxis(x, axis, -1), k)
    expect = tuple(jnp.moveaxis(e, -1, axis) for e in expect)
    got = jax.jit(top_k, static_argnums=(1, 2))(x, k, axis)
    _assert_same(expect, got)


def test_blocking_engages_on_long_axes_only():
    assert block_size(4096, 10) == 16
    assert block_size(100, 10) is None  # too few blocks per wanted element
    assert block_size(32, 1) is None


def test_float64_and_bfloat16_keys():
    rng = np.random.default_rng(0)
    for dtype in (jnp.bfloat16, jnp.float16):
        x = jnp.asarray(rng.integers(-20, 20, (3, 2000)), dtype)
        _assert_same(lax.top_k(x, 7), top_k(x, 7))
    with jax.enable_x64(True):
        x = jnp.asarray(rng.standard_normal((2, 5000)))
        _assert_same(lax.top_k(x, 5), top_k(x, 5))


@pytest.mark.parametrize("dup", [False, True])
def test_split_knn_with_duplicate_points_matches_jax(dup):
    """A split top_k sink uses the blocked form per chunk; ties keep the lower index."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    y = rng.standard_normal((400_000, 4)).astype(np.float32)
    if dup:
        y[1::2] = y[::2]  # every point twice: equal distances at distinct indices

    def knn(x, y):
        d2 = jnp.sum((x[:, None] - y[None]) ** 2, -1)
        return lax.top_k(-d2, 10)

    f = memsafe.jit(knn, memory_limit="8MiB")
    vals, idx = map(np.asarray, f(x, y))
    (split,) = f.plan(x, y).splits
    assert "top_k" in split.sinks, split  # split along the database axis: a running top_k
    ref_vals, ref_idx = map(np.asarray, jax.jit(knn)(x, y))
    np.testing.assert_allclose(vals, ref_vals, rtol=1e-5, atol=1e-5)  # the distance rule rounds
    if not dup:
        np.testing.assert_array_equal(idx, ref_idx)
        return
    # both copies of each neighbour, the lower index first, as lax.top_k orders ties
    np.testing.assert_array_equal(idx[:, ::2] % 2, 0)
    np.testing.assert_array_equal(idx[:, 1::2], idx[:, ::2] + 1)
    np.testing.assert_array_equal(idx // 2, ref_idx // 2)
