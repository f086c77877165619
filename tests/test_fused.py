"""Fused chunk bodies (memsafe.fused): split regions run as one Pallas kernel, checked in Pallas
interpret mode on the CPU against jax.jit (NaN, infinities, ties, ragged tiles, float32 and
bfloat16), and the CPU's default plans left as they were (fusion off)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe.fused import policy
from memsafe.fused.split import fuse
from memsafe.plan import SplitRecord
from tests.agree import assert_like_jit

#: Small tiles, so that small programs stream several tiles, ragged at both ends.
ON = policy.FusedPolicy(enabled=True, interpret=True, rows=16, cols=32)


@pytest.fixture
def fused_on(monkeypatch):
    monkeypatch.setattr(policy, "FUSED", ON)


def _splits(f, *args) -> list[SplitRecord]:
    return [r for r in f.plan(*args).records if isinstance(r, SplitRecord)]


def _fused(f, *args) -> list[SplitRecord]:
    return [r for r in _splits(f, *args) if any(s.startswith("fused[") for s in r.sinks)]


def _points(seed: int, n: int, m: int, d: int, dtype=np.float32):
    r = np.random.default_rng(seed)
    return r.normal(size=(n, d)).astype(dtype), r.normal(size=(m, d)).astype(dtype)


def _sqdist(x, y):
    return jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1)


def kernel_matvec(x, y, v):
    return jnp.exp(-_sqdist(x, y)) @ v


def kernel_sums(x, y):
    return jnp.sum(jnp.exp(-0.5 * _sqdist(x, y)), axis=1)


def lse_rows(x, y):
    return jax.nn.logsumexp(x @ y.T, axis=1)


def extremes(x, y):
    s = x @ y.T
    return jnp.max(s, axis=1), jnp.min(s, axis=1)


def nearest(x, y):
    d = _sqdist(x, y)
    return jnp.argmin(d, axis=1), jnp.argmax(d, axis=1)


def attention(q, k, v):
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k) / np.float32(np.sqrt(q.shape[-1]))
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v)


# n = 50 rows (tiles of 16: ragged), m = 1000 columns (tiles of 32: the last one overlaps)
N, M, D = 50, 1000, 4
#: Under the 195 KiB of an n x m float32 value: jax.jit's program does not fit.
LIMIT = "96KiB"


def _check_fused(f, *args, limit=LIMIT):
    safe = memsafe.jit(f, memory_limit=limit)
    got = safe(*args)
    assert _fused(safe, *args), safe.plan(*args)
    assert_like_jit(got, f, *args)
    return safe


def test_kernel_matvec(fused_on):
    x, y = _points(0, N, M, D)
    v = np.random.default_rng(1).normal(size=(M,)).astype(np.float32)
    _check_fused(kernel_matvec, x, y, v)


def test_kernel_sums_nan_inf(fused_on):
    x, y = _points(2, N, M, D)
    x[3, 1] = np.nan  # a NaN row
    y[17, 0] = np.inf  # a column at infinite distance: exp gives 0
    y[990, 2] = -np.inf  # in the last, overlapping tile
    _check_fused(kernel_sums, x, y)


def test_logsumexp_rows(fused_on):
    x, y = _points(3, N, M, D)
    x[5] = 0.0  # all scores zero: log(m)
    y[40, 0], x[7, 0] = np.inf, 1.0  # an infinite score
    x[9, :] = np.nan
    _check_fused(lse_rows, x, y)


def test_max_min_ties(fused_on):
    x, y = _points(4, N, M, D)
    x, y = np.round(x), np.round(y)  # integer scores: many ties
    y[100, 1] = np.nan  # NaN wins max and min of the rows it reaches
    _check_fused(extremes, x, y)


def test_argmin_argmax_ties_first_index(fused_on):
    x, y = _points(5, N, M, 2)
    x, y = np.round(x), np.round(y)
    y[500:] = y[:500]  # exact duplicates: the first index must win, across tiles
    x[11, 0] = np.nan  # a NaN row: index 0, as jax.jit
    y[985, 1] = np.nan  # a NaN column, in the overlapping last tile: wins once
    safe = _check_fused(nearest, x, y)
    got = safe(x, y)
    want = jax.jit(nearest)(x, y)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_extremes_and_argmin(fused_on):
    x, y = _points(6, N, M, D)
    x, y = jnp.asarray(np.round(x), jnp.bfloat16), jnp.asarray(np.round(y), jnp.bfloat16)
    _check_fused(extremes, x, y)
    safe = _check_fused(nearest, x, y)
    for a, b in zip(safe(x, y), jax.jit(nearest)(x, y)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_kernel_sums(fused_on):
    x, y = _points(7, N, M, D)
    _check_fused(kernel_sums, jnp.asarray(x, jnp.bfloat16), jnp.asarray(y, jnp.bfloat16))


def test_attention_online(fused_on):
    r = np.random.default_rng(8)
    q, k, v = (r.normal(size=(1, 2, 300, 8)).astype(np.float32) for _ in range(3))
    k[0, 1, 70] = 40.0  # one dominating key: rescaling across tiles
    _check_fused(attention, q, k, v, limit="400KiB")


def test_gradient_program(fused_on):
    x, y = _points(9, N, M, D)
    v = np.random.default_rng(10).normal(size=(M,)).astype(np.float32)

    def loss(x, y, v):
        return jnp.sum(kernel_matvec(x, y, v) ** 2)

    grad = jax.grad(loss)  # the backward's region runs in two stages: two kernels
    safe = memsafe.jit(grad, memory_limit="400KiB")
    got = safe(x, y, v)
    assert _fused(safe, x, y, v), safe.plan(x, y, v)
    assert_like_jit(got, grad, x, y, v)


def test_cpu_default_is_off():
    """On the CPU the default policy leaves every split as the planner chose it."""
    assert policy.FUSED.enabled is None and not policy.FUSED.active()
    x, y = _points(11, N, M, D)
    v = np.random.default_rng(12).normal(size=(M,)).astype(np.float32)
    safe = memsafe.jit(kernel_matvec, memory_limit=LIMIT)
    safe(x, y, v)
    assert _splits(safe, x, y, v) and not _fused(safe, x, y, v)


def test_fuse_returns_the_split_when_off(monkeypatch):
    sentinel = object()
    off = dataclasses.replace(ON, enabled=False)
    assert fuse(None, sentinel, off) is sentinel
