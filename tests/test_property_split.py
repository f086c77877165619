"""Property: for random programs built from splittable primitives, random shapes and limits,
memsafe.jit either returns jax.jit's result with a compiled footprint under the limit, or raises
MemoryLimitError; nothing else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import memsafe
from memsafe.xla import Footprint, memsafe_jit
from tests.budget import examples

BASES = {
    "dot": lambda x, y: x @ y.T,
    "sqdist": lambda x, y: jnp.sum((x[:, None] - y[None]) ** 2, -1),
    "l1": lambda x, y: jnp.sum(jnp.abs(x[:, None] - y[None]), -1),
    "dot_t": lambda x, y: (y @ x.T).T,
}

ELEMENTWISE = {
    "gauss": lambda s: jnp.exp(-s / 4),
    "tanh": jnp.tanh,
    "sin": jnp.sin,
    "affine": lambda s: s * 0.5 + 1.0,
    "relu": lambda s: jnp.where(s > 0, s, 0.0),
    "square": lambda s: s * s,
    "iota": lambda s: s + jnp.arange(s.shape[1], dtype=s.dtype)[None, :] * 1e-3,
    "clip": lambda s: jnp.clip(s, -1.0, 1.0),
}

# Sinks: (function of s and v, whether it returns indices into axis 1 / axis 0).
SINKS = {
    "sum1": (lambda s, v: jnp.sum(s, 1), None),
    "sum0": (lambda s, v: jnp.sum(s, 0), None),
    "max1": (lambda s, v: jnp.max(s, 1), None),
    "min0": (lambda s, v: jnp.min(s, 0), None),
    "matvec": (lambda s, v: s @ v, None),
    "vecmat": (lambda s, v: v.T @ s.T, None),
    "softmax": (lambda s, v: jax.nn.softmax(s, axis=1) @ v, None),
    "logsumexp": (lambda s, v: jax.nn.logsumexp(s, axis=1), None),
    "argmax1": (lambda s, v: jnp.argmax(s, 1), 1),
    "argmin0": (lambda s, v: jnp.argmin(s, 0), 0),
    "topk": (lambda s, v: lax.top_k(s, 3)[1], 1),
}


def _values_at(s, idx, axis):
    """The values of s that indices along ``axis`` point at (compared instead of raw indices, so
    near-ties that chunked float arithmetic may order differently do not fail the property)."""
    s = np.asarray(s)
    idx = np.asarray(idx)
    if axis == 1:
        idx2 = idx if idx.ndim == 2 else idx[:, None]
        return np.take_along_axis(s, idx2, axis=1)
    return np.take_along_axis(s, idx[None, :], axis=0)


@settings(max_examples=examples(20))
@given(
    n=st.integers(2, 48),
    m=st.integers(16, 3000),
    d=st.integers(1, 6),
    p=st.integers(1, 3),
    base=st.sampled_from(sorted(BASES)),
    chain=st.lists(st.sampled_from(sorted(ELEMENTWISE)), max_size=3),
    sinks=st.lists(st.sampled_from(sorted(SINKS)), min_size=1, max_size=2, unique=True),
    frac=st.floats(0.03, 0.8),
    seed=st.integers(0, 2**16),
)
def test_random_programs_fit_or_raise(n, m, d, p, base, chain, sinks, frac, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((n, d), dtype=np.float32))
    y = jnp.asarray(rng.standard_normal((m, d), dtype=np.float32))
    v = jnp.asarray(rng.standard_normal((m, p), dtype=np.float32))

    def scores(x, y):
        s = BASES[base](x, y)
        for name in chain:
            s = ELEMENTWISE[name](s)
        return s

    def prog(x, y, v):
        s = scores(x, y)
        return tuple(SINKS[k][0](s, v) for k in sinks)

    plain = Footprint.from_compiled(memsafe_jit(prog).lower(x, y, v).compile())
    fixed = plain.arguments + plain.outputs
    limit = int(fixed + frac * max(plain.total - fixed, 1)) + 1
    f = memsafe.jit(prog, memory_limit=limit)
    try:
        out = f(x, y, v)
    except memsafe.MemoryLimitError:
        return
    plan = f.plan(x, y, v)
    assert plan.after.total <= limit
    ref = jax.jit(prog)(x, y, v)
    s_ref = jax.jit(scores)(x, y)
    for name, o, r in zip(sinks, out, ref):
        axis = SINKS[name][1]
        if axis is None:
            r = np.asarray(r)
            scale = max(1.0, float(np.abs(r).max()))
            np.testing.assert_allclose(np.asarray(o), r, rtol=2e-4, atol=2e-4 * scale)
        else:
            np.testing.assert_allclose(
                _values_at(s_ref, o, axis), _values_at(s_ref, r, axis), rtol=1e-5, atol=1e-5
            )
