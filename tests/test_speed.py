"""The planner's speed constants per backend (memsafe.split.speed): the platform picks them, and
each one sets the choice it is for, with the same answers."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe import _jax, cache
from memsafe.split import speed

MiB = 2**20


@pytest.mark.parametrize(
    "platform, expected",
    [("cpu", speed.CPU), ("cuda", speed.GPU), ("rocm", speed.GPU), ("tpu", speed.CPU)],
)
def test_each_platform_has_its_constants(platform, expected, monkeypatch):
    monkeypatch.setattr(_jax, "lowering_platform", lambda: platform)
    assert speed.current() == expected


def _planned(fun, args, limit, monkeypatch, **changes):
    """memsafe's answer and plan under ``limit`` with the speed constants changed."""
    cache.clear()
    changed = speed.Speed(**{**vars(speed.CPU), **changes})
    monkeypatch.setattr(speed, "current", lambda: changed)
    safe = memsafe.jit(fun, memory_limit=limit)
    out = jax.block_until_ready(safe(*args))
    plan = safe.plan(*args)
    assert plan.after.total <= limit
    return out, plan


def _kernel_matvec(x, y, v):
    d = jnp.sum((x[:, None] - y[None]) ** 2, -1)
    return jnp.exp(-d / 2) @ v


def test_the_speed_cap_sets_a_memory_bound_chunk(monkeypatch):
    rng = np.random.default_rng(0)
    x, y = (rng.normal(size=(2048, 3)).astype(np.float32) for _ in range(2))
    v = rng.normal(size=2048).astype(np.float32)
    limit = 6 * MiB  # jax.jit needs 16 MiB for the distances
    small, small_plan = _planned(_kernel_matvec, (x, y, v), limit, monkeypatch,
                                 chunk_bytes=64 * 1024)  # fmt: skip
    large, large_plan = _planned(_kernel_matvec, (x, y, v), limit, monkeypatch,
                                 chunk_bytes=MiB)  # fmt: skip
    (a,), (b,) = small_plan.splits, large_plan.splits
    assert b.chunk >= 8 * a.chunk, (a.chunk, b.chunk)
    want = jax.jit(_kernel_matvec)(x, y, v)
    for got in (small, large):
        np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * float(jnp.abs(want).max()))


def _knn(x, y):
    return jax.lax.top_k(-(x @ y.T), 5)


def test_the_tile_width_sets_the_selection_tiles(monkeypatch):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(256, 16)).astype(np.float32)
    y = rng.normal(size=(65536, 16)).astype(np.float32)
    limit = 16 * MiB
    narrow, narrow_plan = _planned(_knn, (x, y), limit, monkeypatch, tile_bytes=256 * 1024)
    wide, wide_plan = _planned(_knn, (x, y), limit, monkeypatch, tile_bytes=4 * MiB)
    tiles = [
        int(re.search(r"in tiles of (\d+)", str(p)).group(1)) for p in (narrow_plan, wide_plan)
    ]
    assert tiles[1] > tiles[0], tiles
    want = jax.jit(_knn)(x, y)
    for got in (narrow, wide):
        np.testing.assert_array_equal(got[1], want[1])
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5)  # products in other orders
