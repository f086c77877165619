"""Layout ops that move positions along the split axis (rev, pad, concatenate, offset and strided
slices, dynamic slices) read each chunk from their whole operands: the region along the moved
axis is emitted in chunks with a remainder and equals jax.jit, ties and NaN included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe.graph import Graph, inline_calls
from memsafe.split.emit import emit
from memsafe.split.planner import strategy
from memsafe.split.region import grow
from memsafe.xla import memsafe_jit

N, M, D = 16, 2048, 4

# Each moves positions of y (a program argument) along the axis the product is split on.
PROGRAMS = {
    "rev": lambda x, y: jnp.max(x @ jnp.flip(y, 0).T, 0),
    "pad": lambda x, y: jnp.max(x @ jnp.pad(y, ((3, 5), (0, 1)), constant_values=2.0)[:, :D].T, 0),
    "pad_interior": lambda x, y: jnp.argmax(x @ lax.pad(y, 1.5, ((1, 2, 1), (0, 0, 0))).T, 0),
    "concatenate": lambda x, y: jnp.min(x @ jnp.concatenate([y[::-1], 2 * y], 0).T, 0),
    "offset_slice": lambda x, y: jnp.max(x @ y[7:].T, 0),
    "strided_slice": lambda x, y: jnp.sum(jnp.exp(x @ y[1::3].T), 0),
    "dynamic_slice": lambda x, y: jnp.max(x @ lax.dynamic_slice_in_dim(y, N, M // 2).T, 0),
}


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.integers(-2, 3, (N, D)).astype(np.float32)  # integer values: many exact ties
    y = rng.integers(-2, 3, (M, D)).astype(np.float32)
    y[100, 1] = np.nan
    return jnp.asarray(x), jnp.asarray(y)


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_moved_positions_are_read_per_chunk(name):
    fun = PROGRAMS[name]
    x, y = _inputs()
    closed = inline_calls(jax.make_jaxpr(fun)(x, y))
    graph = Graph(closed)
    seed = next(e.outvars[0] for e in graph.eqns if e.primitive.name == "dot_general")
    region = grow(graph, seed, 1, 1, 10**9)
    new = emit(closed, graph, strategy(graph, region), 300)
    assert "scan" in str(new.jaxpr)
    got = memsafe_jit(lambda *a: jax.core.eval_jaxpr(new.jaxpr, new.consts, *a))(x, y)
    np.testing.assert_allclose(got[0], memsafe_jit(fun)(x, y), rtol=1e-6)


def test_reversed_database_knn_under_the_limit():
    """End to end: a kNN against a reversed, padded database splits it under the limit."""

    def knn(q, db):
        db = jnp.pad(jnp.flip(db, 0), ((0, 7), (0, 0)))
        d = jnp.sum(q**2, 1)[:, None] - 2 * q @ db.T + jnp.sum(db**2, 1)[None]
        return lax.top_k(-d, 5)

    rng = np.random.default_rng(1)
    q = rng.standard_normal((64, 8), dtype=np.float32)
    db = rng.standard_normal((40_000, 8), dtype=np.float32)
    f = memsafe.jit(knn, memory_limit="4MiB")
    plan = f.plan(q, db)
    assert plan.splits and plan.after.total <= 4 * 2**20
    got, want = f(q, db), memsafe_jit(knn)(q, db)
    np.testing.assert_array_equal(got[1], want[1])
