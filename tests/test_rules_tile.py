"""Broadcasts and tiles that only feed a product are multiplied before they are broadcast
(seeds 000/001's tiled context): same results, fewer bytes, measured by XLA."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from examples import hutchinson as H
from memsafe.rewrite.algebraic import rewritten
from memsafe.xla import memsafe_jit


def _rand(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def _rules(f, *args):
    g = rewritten(f)
    check = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    jax.tree_util.tree_map(check, g(*args), jax.jit(f)(*args))
    return [r.rule for r in g.plan(*args).rules]


def test_tiled_context_times_weight():
    z, w = _rand((8, 256)), _rand((256, 16), 1)
    tiled = lambda z, w: jnp.tile(z[:, None, :], (1, 100, 1)) @ w
    repeated = lambda z, w: jnp.repeat(z[:, None, :], 100, axis=1) @ w
    broadcast = lambda z, w: jnp.broadcast_to(z[:, None, :], (8, 100, 256)) @ w
    for f in (tiled, repeated, broadcast):
        assert _rules(f, z, w) == ["broadcast_into_dot"]


def test_no_rewrite_where_nothing_is_broadcast_or_it_is_stored_anyway():
    z, w = _rand((8, 256)), _rand((256, 16), 1)
    assert _rules(lambda z, w: jnp.tile(z, (100, 1)) @ w, z, w) == []  # real repetition
    u = _rand((16,), 2)  # broadcast along the contracted axis only: no free axis to shrink
    assert _rules(lambda z, u: z @ jnp.broadcast_to(u[None, :], (256, 16)), z, u) == []
    stored = lambda z, w: (lambda t: (t @ w, t))(jnp.tile(z[:, None], (1, 100, 1)))
    assert _rules(stored, z, w) == []


@pytest.mark.parametrize("form", ["traces_tiled", "traces_broadcast"])
def test_hutchinson_estimates_unchanged(form):
    inputs = H.make_inputs(4, 50, 2, 256)
    f = getattr(H, form)
    assert _rules(f, *inputs) == ["broadcast_into_dot"] * 2


def test_hutchinson_at_seed_sizes_temps_fall_measured():
    """B=64, N=1000, Dc=512 (seed 001): XLA stores the (B, N, D + Dc + 1) concatenation and its
    tangent whether z is tiled or broadcast; multiplied before broadcasting, neither is stored."""
    inputs = H.make_inputs(64, 1000, 2, 512)
    avals = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), inputs)
    f = H.traces_tiled
    before = memsafe_jit(f).lower(*avals).compile().memory_analysis().temp_size_in_bytes
    after = memsafe_jit(rewritten(f)).lower(*avals).compile().memory_analysis().temp_size_in_bytes
    concat = 64 * 1000 * 515 * 4
    assert before > 2 * concat
    assert after < before - 2 * concat + 16 * 2**20
    assert after * 5 < before
