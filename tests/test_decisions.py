"""Decisions a gradient re-derives see the forward's bits (issue 39).

The gradient of a selection (``max``, ``min``, ``segment_max``, ``top_k``, ``sort``, an argmax
pick, a clamp, a ``where`` on a comparison) compares values with what the forward found. Split
along the selected axis in stages, a later loop recomputes the values per chunk and compares them
with the maxima an earlier loop found; XLA compiles each loop on its own, and a chain with an
inexact constant (``/ 0.9``) or reassociable products was rounded otherwise in each: no value
equalled its maximum and the gradient was dropped (37% off for a graph network). Every program
here puts such a chain (inexact constants, reassociable products, a bfloat16 detour) before a
selection along the split axis, and its gradient must obey the accuracy rule against jax.jit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from tests.agree import assert_like_jit
from tests.limits import limit_between

N, E, F, D = 420, 12000, 16, 16


def _chain(kind: str, h: jax.Array, u: jax.Array) -> jax.Array:
    """Per-edge messages through a product chain whose rounding depends on how XLA fuses it."""
    if kind == "dropout":  # the issue's program: dropout by 0.9, then a gate
        m = h * (u >= 0.1).astype(h.dtype) / 0.9
        return m * jax.nn.sigmoid(jnp.sum(m, -1, keepdims=True))
    if kind == "products":  # constants a simplifier may fold together
        return h * 3.0 * jnp.exp(u) / 0.7 * (1.0 + u) * 1.1
    if kind == "bfloat16":  # ``u`` arrives in bfloat16 (exactly widened), then inexact scaling
        m = h * u
        return (m + h) / 0.3 * jax.nn.sigmoid(jnp.sum(h, -1, keepdims=True) * 0.7)
    if kind == "scan":  # a loop over layers, run again on each chunk in each stage
        layer = lambda m, s: (jnp.tanh(m * s) / 0.9 * 1.1, None)
        return lax.scan(layer, h * u, jnp.linspace(0.5, 1.5, 3))[0]
    if kind == "checkpoint":  # a rematerialized chain: the backward recomputes it
        chain = lambda h, u: h * (u >= 0.1).astype(h.dtype) / 0.9 * jnp.exp(u) * 1.1
        return jax.checkpoint(chain)(h, u)
    raise ValueError(kind)


def _select(kind: str, m: jax.Array, rcv: jax.Array, c: jax.Array) -> jax.Array:
    """A loss that picks among the messages along the edges (axis 0)."""
    if kind == "segment_max":
        a = jax.ops.segment_max(m, rcv, num_segments=N)
        return jnp.sum(jnp.where(jnp.isfinite(a), a, 0.0) * c)
    if kind == "segment_min":
        a = jax.ops.segment_min(m, rcv, num_segments=N)
        return jnp.sum(jnp.where(jnp.isfinite(a), a, 0.0) * c)
    if kind == "max":
        return jnp.sum(jnp.max(m, axis=0) * c[0])
    if kind == "min":
        return jnp.sum(jnp.min(m, axis=0) * c[0])
    if kind == "top_k":
        values, _ = lax.top_k(m.T, 3)
        return jnp.sum(values * c[:3].T)
    if kind == "sort":  # each edge's features sorted, its largest few weighed by the receiver's
        return jnp.sum(jnp.sort(m, axis=-1)[:, -3:] * c[rcv, :3])
    if kind == "argmax":  # each feature's message at the edge that maximizes another score
        pick = jnp.argmax(m * 1.3 - 0.2, axis=0)
        return jnp.sum(jnp.take_along_axis(m, pick[None], axis=0) * c[0])
    if kind == "clamp":  # ReLU and a clamp, decided on recomputed values, then the maximum
        r = jnp.clip(jax.nn.relu(m - 0.05), 0.0, 0.8)
        return jnp.sum(jnp.max(r, axis=0) * c[0]) + jnp.sum(r) * 1e-3
    if kind == "where":
        big = m > jnp.max(m, axis=0) * 0.9
        return jnp.sum(jnp.where(big, m, 0.0) * c[rcv])
    raise ValueError(kind)


def _program(chain: str, select: str):
    def loss(w, nodes, snd, rcv, u, c):
        h = jnp.tanh(nodes[snd] @ w)
        return _select(select, _chain(chain, h, u), rcv, c)

    return jax.grad(loss)


def _args(chain: str, seed: int = 300428):
    """Weights, node features, senders, receivers, per-edge noise ``u`` (bfloat16 for the
    ``bfloat16`` chain: mixed dtypes, without the excess precision XLA may keep where a
    bfloat16 result is widened again, which jax.jit's answer would depend on) and targets."""
    rng = np.random.default_rng(seed)
    u_dtype = jnp.bfloat16 if chain == "bfloat16" else jnp.float32
    return (
        jnp.asarray(rng.standard_normal((D, F)) * D**-0.5, jnp.float32),
        jnp.asarray(rng.standard_normal((N, D)), jnp.float32),
        jnp.asarray(rng.integers(0, N, E), jnp.int32),
        jnp.asarray(rng.integers(0, N - N // 10, E), jnp.int32),  # some segments stay empty
        jnp.asarray(rng.random((E, F)), u_dtype),
        jnp.asarray(rng.standard_normal((N, F)), jnp.float32),
    )


CASES = [
    ("dropout", "segment_max"),
    ("products", "segment_max"),
    ("bfloat16", "segment_max"),
    ("dropout", "segment_min"),
    ("products", "max"),
    ("dropout", "min"),
    ("bfloat16", "max"),
    ("dropout", "top_k"),
    ("products", "sort"),
    ("dropout", "argmax"),
    ("products", "clamp"),
    ("dropout", "where"),
    ("scan", "segment_max"),
    ("scan", "argmax"),
    ("checkpoint", "segment_max"),
    ("checkpoint", "top_k"),
]


@pytest.mark.parametrize(("chain", "select"), CASES)
def test_a_selection_gradient_split_along_the_edges_keeps_jax_jits_answer(chain, select):
    g, args = _program(chain, select), _args(chain)
    limit = limit_between(g, args, 0.25)
    f = memsafe.jit(g, memory_limit=limit)
    plan = f.plan(*args)
    assert plan.after.total <= limit
    assert any(s.size == E for s in plan.splits), plan  # split along the edges
    assert_like_jit(f(*args), g, *args)


def test_the_issues_graph_network_gradient():
    """The program of issue 39, verbatim, at its limit of 6.7 MB."""
    n, e = 1651, 52832
    rng = np.random.default_rng(300428)
    w = jnp.asarray(rng.standard_normal((D, F)) * D**-0.5, jnp.float32)
    nodes = jnp.asarray(rng.standard_normal((n, D)), jnp.float32)
    snd = jnp.asarray(rng.integers(0, n, e), jnp.int32)
    rcv = jnp.asarray(rng.integers(0, n - n // 10, e), jnp.int32)
    u = jnp.asarray(rng.random((e, F)), jnp.float32)
    c = jnp.asarray(rng.standard_normal((n, F)), jnp.float32)

    def loss(w, nodes, snd, rcv, u):
        m = jnp.tanh(nodes[snd] @ w)
        m = m * (u >= 0.1).astype(m.dtype) / 0.9
        m = m * jax.nn.sigmoid(jnp.sum(m, -1, keepdims=True))
        a = jax.ops.segment_max(m, rcv, num_segments=n)
        return jnp.sum(jnp.where(jnp.isfinite(a), a, 0.0) * c)

    g, args = jax.grad(loss), (w, nodes, snd, rcv, u)
    f = memsafe.jit(g, memory_limit=6_743_411)
    assert any(s.size == e for s in f.plan(*args).splits)
    assert_like_jit(f(*args), g, *args)
