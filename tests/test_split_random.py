"""Random bits over a split axis are generated chunk by chunk, equal to the whole result's slice:
dropout in attention and sampled noise split without the mask ever existing whole."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memsafe
from memsafe.split import random_bits
from memsafe.split.registry import PLAIN, Mapping, axis_map
from tests.agree import assert_like_jit


@settings(max_examples=10)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=3),
    data=st.data(),
    width=st.sampled_from([8, 16, 32, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_chunk_bits_equal_the_slice_of_the_whole(shape, data, width, seed):
    shape = tuple(shape)
    axis = data.draw(st.integers(0, len(shape) - 1))
    start = data.draw(st.integers(0, shape[axis] - 1))
    size = data.draw(st.integers(1, shape[axis] - start))
    key = jax.random.key(seed)
    with jax.enable_x64(width == 64):
        dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32, 64: jnp.uint64}[width]
        whole = jax.random.bits(key, shape, dtype)
        got = jax.jit(random_bits.chunk_bits, static_argnums=(1, 2, 3, 5))(
            key, shape, width, axis, start, size
        )
        want = jax.lax.slice_in_dim(whole, start, start + size, axis=axis)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_keys_and_settings_that_cannot_be_chunked_are_refused():
    aval = jax.typeof(jax.random.key(0))
    assert random_bits.why_not(aval, (4, 4)) is None
    rbg = jax.typeof(jax.random.key(0, impl="rbg"))
    assert "threefry" in random_bits.why_not(rbg, (4, 4))
    many = jax.typeof(jax.random.split(jax.random.key(0), 3))
    assert random_bits.why_not(many, (4, 4)) is None  # each key's bits chunk by chunk


def test_chunk_bits_of_an_array_of_keys_equal_each_keys_slice():
    keys = jax.random.split(jax.random.key(3), (2, 3))
    whole = jax.vmap(jax.vmap(lambda k: jax.random.bits(k, (40, 7))))(keys)
    got = jax.jit(random_bits.chunk_bits, static_argnums=(1, 2, 3, 5))(keys, (40, 7), 32, 0, 9, 13)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(whole[:, :, 9:22]))


def test_random_bits_of_an_array_of_keys_map_along_keys_or_samples():
    keys = jax.random.split(jax.random.key(0), 3)
    eqn = jax.make_jaxpr(lambda k: jax.vmap(lambda k: jax.random.bits(k, (5, 6)))(k))(keys)
    (bits,) = [e for e in eqn.jaxpr.eqns if e.primitive.name == "random_bits"]
    assert axis_map(bits, ("out", 0), 0, PLAIN) == Mapping(ins=(0,), outs=(0,))  # the keys
    assert axis_map(bits, ("out", 0), 2, PLAIN) == Mapping(ins=(None,), outs=(2,))  # each's


@pytest.mark.parametrize("axis", ["keys", "rows"])
def test_dropout_under_vmap_splits_with_an_array_of_keys(axis):
    """``jax.vmap`` of a dropout over a key per example (fuzz seed 44 refused it: random bits of
    an array of keys) splits, many examples of few rows or few of many, with jax.jit's bits."""

    def drop(h, label):
        key = jax.random.fold_in(jax.random.key(44), label)
        keep = jax.random.uniform(key, h.shape, jnp.float32) < 0.8
        return jnp.sum(jnp.where(keep, jnp.tanh(h) / 0.8, 0.0), axis=-1)

    rng = np.random.default_rng(0)
    batch, rows = (64, 16) if axis == "keys" else (2, 512)
    h = jnp.asarray(rng.standard_normal((batch, rows, 2048)), jnp.float32)
    labels = jnp.arange(batch, dtype=jnp.int32)
    fun = jax.vmap(drop)
    limit = h.nbytes + 2 * 2**20  # the mask alone is as large as h
    ms = memsafe.jit(fun, memory_limit=limit)
    plan = ms.plan(h, labels)
    assert plan.after.total <= limit and plan.splits, plan
    assert any("random_bits" in s.ops for s in plan.splits), plan
    assert_like_jit(ms(h, labels), fun, h, labels)  # the same mask: sums agree to rounding


def dropout_attention(q, k, v, key):
    """Attention with dropout on the weights, as flax's dot_product_attention applies it."""
    w = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1]), axis=-1)
    keep = jax.random.bernoulli(key, 0.9, w.shape)
    return jnp.einsum("hqk,khd->qhd", jnp.where(keep, w / 0.9, 0.0), v)


@pytest.mark.parametrize("grad", [False, True])
def test_attention_with_dropout_splits_under_the_limit(grad):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1024, 4, 32), dtype=np.float32)) for _ in "qkv")
    key = jax.random.key(7)
    fun = dropout_attention
    if grad:
        fun = jax.grad(lambda q, k, v, key: jnp.sum(dropout_attention(q, k, v, key) ** 2))
    limit = 6 * 2**20  # the weights alone are 16 MiB
    ms = memsafe.jit(fun, memory_limit=limit)
    plan = ms.plan(q, k, v, key)
    assert plan.before.total >= 4 * limit and plan.after.total <= limit, plan
    np.testing.assert_allclose(ms(q, k, v, key), jax.jit(fun)(q, k, v, key), rtol=2e-5, atol=2e-6)
