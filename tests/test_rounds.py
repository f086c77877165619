"""Programs that run the same split work in rounds, each round reading what the round before
wrote (a graph network's message passing): each round's loops start from their own
accumulators, and a later stage of a split region reads the values an earlier stage wrote
rather than computing them again from the region's inputs.

- ``memsafe.split.loop.apart``: a segment sum (max, min) starts from a broadcast zero (-inf,
  inf) that its loop updates in place. The same broadcast before several loops is one buffer
  to XLA's CSE, copied by every loop but the last, and XLA scheduled the copies at the start:
  the fills are made per loop, under a ``lax.cond`` whose branches make the same values.
- ``memsafe.split.region.Region.read_back``: a region split along the nodes over all rounds
  (each round's node update a stage) computed every round's update again from the segment sums
  in its last stage, holding the sums of every round until then.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import memsafe
from tests.agree import assert_like_jit
from tests.limits import limit_between


def _network(rounds: int):
    def f(params, x, edges, labels):
        h, n = x, x.shape[0]
        snd, rcv = labels[:, 0], labels[:, 1]
        for w_msg, b_msg, w_upd in params[:rounds]:
            hs = jnp.take(h, snd, axis=0, mode="clip")
            hr = jnp.take(h, rcv, axis=0, mode="clip")
            m = jnp.tanh(jnp.concatenate([hs, hr, edges], axis=-1) @ w_msg + b_msg)
            aggs = [jax.ops.segment_sum(m, rcv, n, indices_are_sorted=True)]
            for reduce in (jax.ops.segment_max, jax.ops.segment_min):
                a = reduce(m, rcv, n, indices_are_sorted=True)
                aggs.append(jnp.where(jnp.isfinite(a), a, 0))
            h = h + jnp.tanh(jnp.concatenate([h, *aggs], axis=-1) @ w_upd)
        return jnp.mean(jax.nn.logsumexp(h, axis=-1) - h[:, 0])

    return f


def _inputs(nodes: int, edges: int, features: int, hidden: int, rounds: int, seed: int = 0):
    rng = np.random.default_rng(seed)

    def dense(*shape):
        return jnp.asarray(rng.standard_normal(shape) * shape[0] ** -0.5, jnp.float32)

    params = [
        (dense(3 * features, hidden), dense(1, hidden)[0], dense(features + 3 * hidden, features))
        for _ in range(rounds)
    ]
    x = jnp.asarray(rng.standard_normal((nodes, features)), jnp.float32)
    edge_features = jnp.asarray(rng.standard_normal((edges, features)), jnp.float32)
    rcv = np.sort(rng.integers(0, nodes - nodes // 10, edges))  # some nodes receive nothing
    labels = np.stack([rng.integers(0, nodes, edges), rcv], axis=1)
    return params, x, edge_features, jnp.asarray(labels, jnp.int32)


def test_rounds_of_segment_reductions_split_along_edges():
    """Three rounds of messages over 10,000 edges into 440 nodes (segment sum, max and min of
    each round's messages), under a limit 12% of the way from arguments+outputs to jax.jit's
    footprint: split along the edges (main refused it)."""
    f = _network(3)
    args = _inputs(nodes=440, edges=10_000, features=8, hidden=32, rounds=3)
    limit = limit_between(f, args, 0.12)
    g = memsafe.jit(f, memory_limit=limit)
    plan = g.plan(*args)
    assert plan.after.total <= limit, plan
    assert any(s.axis == 0 and s.size == 10_000 for s in plan.splits), plan
    assert_like_jit(g(*args), f, *args)
