"""Gathers that index the split axis (``take_along_axis`` over it, ``x[rows, cols]``) run as
``pick`` sinks: each chunk supplies the positions it holds. Contrastive losses need them: the
label logits of a cross-entropy over the columns of a row-split logit matrix."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import memsafe


def _sinks(plan) -> set[str]:
    return {kind for split in plan.splits for kind in split.sinks}


def _pick_program(cols: int, mode: str, two_index: bool):
    def f(a, b, idx):
        big = jnp.exp(a[:, None] * b[None, :]) - a[:, None]  # (rows, cols), split along rows
        if two_index:
            picked = big.at[idx, jnp.arange(cols)].get(mode=mode)
        else:
            picked = jnp.take_along_axis(big, idx[None, :], axis=0, mode=mode)[0]
        return picked, jnp.max(big, axis=0)

    return f


def _pick_inputs(rows: int, cols: int, out_of_range: bool, seed: int):
    rng = np.random.default_rng(seed)
    a = jnp.asarray(rng.standard_normal(rows, dtype=np.float32))
    b = jnp.asarray(rng.standard_normal(cols, dtype=np.float32))
    idx = rng.integers(-rows, rows, cols)  # negative positions count from the end
    if out_of_range:
        idx[:2] = [rows + 3, -rows - 7]
    return a, b, jnp.asarray(idx, dtype=jnp.int32)


@settings(max_examples=12)
@given(
    rows=st.integers(2000, 6000),
    cols=st.integers(64, 256),
    mode=st.sampled_from(["clip", "fill", "promise_in_bounds"]),
    two_index=st.booleans(),
    out_of_range=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_pick_sink_equals_jax(rows, cols, mode, two_index, out_of_range, seed):
    """Clipped, filled (NaN where out of range) and in-bounds picks, by one or two index arrays:
    the split result equals jax.jit's bit for bit, or memsafe says the limit cannot be met."""
    args = _pick_inputs(rows, cols, out_of_range and mode != "promise_in_bounds", seed)
    f = _pick_program(cols, mode, two_index)
    ms = memsafe.jit(f, memory_limit=rows * cols + 64 * 1024)  # a quarter of the matrix
    try:
        got = ms(*args)
    except memsafe.MemoryLimitError:
        return
    assert ms.plan(*args).after.total <= rows * cols + 64 * 1024
    for g, w in zip(got, jax.jit(f)(*args)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("two_index", [False, True])
def test_a_gather_over_the_split_axis_is_a_pick_sink(two_index):
    args = _pick_inputs(20_000, 128, True, 0)
    f = _pick_program(128, "fill", two_index)
    ms = memsafe.jit(f, memory_limit="2MiB")  # the matrix is 9.8 MiB
    assert "pick" in _sinks(ms.plan(*args))
    got, want = ms(*args), jax.jit(f)(*args)
    assert np.isnan(np.asarray(want[0])).any()  # out-of-range positions are filled
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def clip_loss(img, txt, log_scale):
    """CLIP's symmetric loss as open_clip/optax users write it."""
    img = img / jnp.linalg.norm(img, axis=-1, keepdims=True)
    txt = txt / jnp.linalg.norm(txt, axis=-1, keepdims=True)
    logits = img @ txt.T * jnp.exp(log_scale)
    labels = jnp.arange(img.shape[0])
    rows = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    cols = optax.softmax_cross_entropy_with_integer_labels(logits.T, labels).mean()
    return (rows + cols) / 2


def nt_xent(z, temperature):
    """SimCLR's NT-Xent: each row's positive is its pair, itself masked out."""
    z = z / jnp.linalg.norm(z, axis=1, keepdims=True)
    n = z.shape[0] // 2
    sim = z @ z.T / temperature
    sim = jnp.where(jnp.eye(2 * n, dtype=bool), -jnp.inf, sim)
    pos = jnp.concatenate([jnp.arange(n, 2 * n), jnp.arange(n)])
    return jnp.mean(jax.nn.logsumexp(sim, axis=1) - sim[jnp.arange(2 * n), pos])


@pytest.mark.parametrize("loss", ["clip", "nt_xent"])
def test_contrastive_losses_split_under_the_limit(loss):
    rng = np.random.default_rng(0)
    b, d = 4096, 64
    if loss == "clip":
        fun = clip_loss
        args = (
            jnp.asarray(rng.standard_normal((b, d), dtype=np.float32)),
            jnp.asarray(rng.standard_normal((b, d), dtype=np.float32)),
            jnp.float32(2.0),
        )
    else:
        fun = nt_xent
        args = (jnp.asarray(rng.standard_normal((b, d), dtype=np.float32)), jnp.float32(0.5))
    limit = 16 * 2**20  # one logit matrix is 64 MiB; plain jit holds several
    ms = memsafe.jit(fun, memory_limit=limit)
    plan = ms.plan(*args)
    assert plan.before.total >= 8 * limit and plan.after.total <= limit, plan
    assert "pick" in _sinks(plan)
    np.testing.assert_allclose(ms(*args), jax.jit(fun)(*args), rtol=2e-6)


@pytest.mark.parametrize("loss", ["clip", "nt_xent"])
def test_contrastive_loss_gradients_split_under_the_limit(loss):
    """The VJP of a pick is a scatter-add over the split axis: each chunk of the cotangent takes
    the updates landing in it."""
    rng = np.random.default_rng(1)
    b, d = 4096, 64
    a = jnp.asarray(rng.standard_normal((b, d), dtype=np.float32))
    if loss == "clip":
        t = jnp.asarray(rng.standard_normal((b, d), dtype=np.float32))
        fun = jax.grad(lambda a, t: clip_loss(a, t, jnp.float32(2.0)), argnums=(0, 1))
        args = (a, t)
    else:
        fun = jax.grad(lambda z: nt_xent(z, jnp.float32(0.5)))
        args = (a,)
    limit = 16 * 2**20
    ms = memsafe.jit(fun, memory_limit=limit)
    plan = ms.plan(*args)
    assert plan.before.total >= 8 * limit and plan.after.total <= limit, plan
    for got, want in zip(jax.tree.leaves(ms(*args)), jax.tree.leaves(jax.jit(fun)(*args))):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-7)
