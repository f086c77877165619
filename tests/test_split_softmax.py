"""Online softmax in the splitting pass: max-shifted exp-sums split along their reduced axis run
as ONE loop with a running max and rescaled accumulators (memory-efficient attention), equal to
jax.jit forward and backward, under the limit; other staged structures keep their stages."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.special import logsumexp

import memsafe
from memsafe._jax import jaxpr_as_fun
from memsafe.graph import Graph, inline_calls
from memsafe.split import planner
from memsafe.split.region import grow
from memsafe.split.strategies import online


def _data(*shapes, seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(scale * rng.standard_normal(s, dtype=np.float32)) for s in shapes]


def _close(out, ref, tol=2e-5):
    for o, r in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
        o, r = np.asarray(o), np.asarray(r)
        scale = max(1.0, float(np.abs(r).max()))
        np.testing.assert_allclose(o, r, atol=tol * scale, rtol=tol)


def _compiled_total(f, args):
    m = f.lower(*args).compile().memory_analysis()
    return (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
        + m.generated_code_size_in_bytes
    )


def _fits(f, args, limit):
    """The plan split something, plain jit needed more than the limit and twice the temps,
    and XLA's buffer assignment of the program that runs is under the limit."""
    plan = f.plan(*args)
    assert plan.splits, plan
    assert plan.before.total > limit and plan.before.temps >= 2 * plan.after.temps, plan
    assert _compiled_total(f, args) <= limit, plan
    return plan


def _one_online_loop(split):
    assert "online_softmax" in split.sinks, split
    assert split.loops == -(-split.size // split.chunk), split  # one pass over the axis


# -- programs -------------------------------------------------------------------------------


def attention(q, k, v):
    s = jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)


def causal_attention(q, k, v):
    s = jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(q.shape[-1])
    lq, lk = q.shape[1], k.shape[1]
    mask = jnp.tril(jnp.ones((lq, lk), bool), k=lk - lq)
    s = jnp.where(mask, s, jnp.finfo(s.dtype).min)
    return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)


def late_keys_attention(q, k, v):
    """Each query sees only the keys at or after a query-dependent position, masked with -inf:
    for most rows the first chunks are entirely -inf (the running max starts at -inf)."""
    s = jnp.einsum("hqd,hkd->hqk", q, k)
    lq, lk = q.shape[1], k.shape[1]
    first = (jnp.arange(lq) * (lk // lq))[:, None]
    s = jnp.where(jnp.arange(lk)[None, :] >= first, s, -jnp.inf)
    return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)


def hand_softmax_attention(q, k, v):
    """Softmax written out: two separate maxes, the division before the contraction."""
    s = jnp.einsum("hqd,hkd->hqk", q, k)
    e = jnp.exp(s - s.max(-1, keepdims=True))
    return jnp.einsum("hqk,hkd->hqd", e / e.sum(-1, keepdims=True), v)


def lse_scipy(h, w):
    return logsumexp(h @ w, axis=1)


def lse_nn(h, w):
    return jax.nn.logsumexp(h @ w, axis=1)


def log_softmax_xent(h, w, labels):
    onehot = jax.nn.one_hot(labels, w.shape[1])
    return -jnp.sum(onehot * jax.nn.log_softmax(h @ w, axis=1))


def info_nce(a, b):
    """Symmetric contrastive loss: log-sum-exp over rows and over columns of the similarities."""
    logits = a @ b.T * 4.0
    pos = jnp.sum(a * b, 1) * 4.0
    return jnp.mean(logsumexp(logits, 1)) + jnp.mean(logsumexp(logits, 0)) - 2 * jnp.mean(pos)


def centred_square_sum(x, y):
    """Two passes that are not a softmax: the row mean before the squared deviations."""
    s = x @ y.T
    return jnp.sum((s - s.mean(1, keepdims=True)) ** 2, 1)


def _attention_args(lq=4, lk=40_000, heads=2, d=2, seed=0):
    return _data((heads, lq, d), (heads, lk, d), (heads, lk, d), seed=seed)


ATTENTIONS = [attention, causal_attention, late_keys_attention, hand_softmax_attention]


# -- the structure, on the program ------------------------------------------------------------


def _region_along(f, args, axis, closed=None):
    closed = closed or inline_calls(jax.make_jaxpr(f)(*args))
    graph = Graph(closed)
    seed = next(e.outvars[0] for e in graph.eqns if e.primitive.name == "dot_general")
    return graph, grow(graph, seed, axis, 1 << 10, 1 << 30)


@pytest.mark.parametrize(
    ("fun", "online_ok"),
    [
        (attention, True),
        (causal_attention, True),
        (late_keys_attention, True),
        (hand_softmax_attention, True),
        (lse_scipy, True),
        (lse_nn, True),
        (log_softmax_xent, False),  # the shifted logits themselves are used, not only their exp
        (centred_square_sum, False),
    ],
)
def test_online_structure_is_detected_on_the_jaxpr(fun, online_ok):
    if fun in ATTENTIONS:
        args, axis = _attention_args(lq=8, lk=300), 2
    elif fun is centred_square_sum:
        args, axis = _data((8, 4), (300, 4)), 1
    else:
        args, axis = _data((8, 4), (4, 300)), 1
        if fun is log_softmax_xent:
            args.append(jnp.arange(8) * 7)
    graph, region = _region_along(fun, args, axis)
    assert region.n_stages >= 2
    split = planner.strategy(graph, region)
    assert isinstance(split, online.OnlineSplit) is online_ok
    assert split.region.n_stages == (1 if online_ok else region.n_stages)


# -- end to end under memsafe.jit -------------------------------------------------------------


@pytest.mark.parametrize("fun", ATTENTIONS)
def test_attention_along_keys_runs_one_online_loop(fun, monkeypatch):
    """Few queries, many keys (decoding against a long cache), the chooser told to prefer the
    online split: the keys split in one online loop."""
    monkeypatch.setattr(online.OnlineSplit, "cost_weight", 0.5)
    args = _attention_args()
    limit = 2_000_000
    f = memsafe.jit(fun, memory_limit=limit)
    plan = _fits(f, args, limit)
    (split,) = plan.splits
    assert split.axis == 2 and split.size == 40_000
    _one_online_loop(split)
    _close(f(*args), jax.jit(fun)(*args))


@pytest.mark.parametrize("fun", [attention, causal_attention])
def test_attention_gradient_with_online_forward(fun, monkeypatch):
    """jax.grad through memsafe.jit: the forward split along keys (online), the VJP program split
    by the pass on its own; gradients equal jax.jit's."""
    monkeypatch.setattr(online.OnlineSplit, "cost_weight", 0.5)  # prefer the online split
    args = _attention_args(lq=64, lk=6000, heads=2, d=8, seed=1)
    limit = 4_000_000

    def loss(q, k, v):
        return 0.5 * jnp.sum(fun(q, k, v) ** 2)

    f = memsafe.jit(loss, memory_limit=limit)
    plan = _fits(f, args, limit)
    _one_online_loop(plan.splits[0])
    assert plan.splits[0].axis == 2
    _close(f(*args), jax.jit(loss)(*args))
    grads = jax.grad(f, argnums=(0, 1, 2))(*args)
    _close(grads, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args), tol=5e-5)


@pytest.mark.parametrize("fun", [lse_scipy, lse_nn])
def test_logsumexp_over_a_large_vocabulary(fun, monkeypatch):
    """Along the vocabulary (the chooser told to prefer the online split): one loop; the gradient
    program splits on its own."""
    monkeypatch.setattr(online.OnlineSplit, "cost_weight", 0.5)
    h, w = _data((64, 16), (16, 20_000), seed=2)
    limit = 4_000_000
    f = memsafe.jit(fun, memory_limit=limit)
    (split,) = _fits(f, (h, w), limit).splits
    assert split.axis == 1
    _one_online_loop(split)
    _close(f(h, w), jax.jit(fun)(h, w))
    g = jax.grad(lambda h, w: jnp.sum(f(h, w)), argnums=(0, 1))(h, w)
    _close(g, jax.grad(lambda h, w: jnp.sum(fun(h, w)), argnums=(0, 1))(h, w), tol=5e-5)


def test_log_softmax_cross_entropy_value_and_gradient():
    """log_softmax uses the shifted logits beyond their exp: the staged fallback, still exact."""
    h, w = _data((64, 16), (16, 20_000), seed=3)
    labels = jnp.asarray(np.random.default_rng(3).integers(0, 20_000, 64))
    args = (h, w, labels)
    limit = 4_000_000
    f = memsafe.jit(log_softmax_xent, memory_limit=limit)
    _fits(f, args, limit)
    _close(f(*args), jax.jit(log_softmax_xent)(*args))
    g = jax.grad(f, argnums=(0, 1))(*args)
    _close(g, jax.jit(jax.grad(log_softmax_xent, argnums=(0, 1)))(*args), tol=5e-5)


def test_symmetric_info_nce_splits_rows_with_online_column_logsumexp():
    """Splitting the rows: the row log-sum-exp is per chunk, the column one runs online."""
    a, b = _data((3000, 8), (3000, 8), seed=4, scale=0.3)
    limit = 4_000_000
    f = memsafe.jit(info_nce, memory_limit=limit)
    (split,) = _fits(f, (a, b), limit).splits
    _one_online_loop(split)
    _close(f(a, b), jax.jit(info_nce)(a, b))
    g = jax.grad(f, argnums=(0, 1))(a, b)
    _close(g, jax.jit(jax.grad(info_nce, argnums=(0, 1)))(a, b), tol=5e-5)


def test_other_two_pass_structures_keep_their_stages():
    """The row mean shifts values that are squared, not exponentiated: two loops remain."""
    x, y = _data((4, 4), (60_000, 4), seed=5)
    limit = 1_300_000
    f = memsafe.jit(centred_square_sum, memory_limit=limit)
    (split,) = _fits(f, (x, y), limit).splits
    assert "online_softmax" not in split.sinks
    assert split.loops >= 2 * -(-split.size // split.chunk)
    _close(f(x, y), jax.jit(centred_square_sum)(x, y), tol=1e-4)


def test_online_loop_emits_one_scan():
    """The emitted program of a 3-stage softmax region has one scan, the staged one three."""
    args = _attention_args(lq=8, lk=1000)
    closed = inline_calls(jax.make_jaxpr(attention)(*args))
    graph, region = _region_along(attention, args, 2, closed)
    from memsafe.split.emit import emit
    from memsafe.split.strategies.staged import StagedSplit

    splits = (StagedSplit(region), online.plan(graph, region))
    scans = [str(emit(closed, graph, s, 96).jaxpr).count("scan[") for s in splits]
    assert scans == [3, 1]


@pytest.mark.parametrize("fun", [attention, late_keys_attention])
def test_online_loop_runs_its_first_chunk_inside(fun):
    """Every chunk's product runs inside the online loop, the first one too: computed before
    the loop, XLA can merge it with a recomputation of the same chunk (a checkpointed layer's
    backward) and keep it alive in between. Keys masked with -inf on the first chunks still
    give jax.jit's answers."""
    args = _attention_args(lq=8, lk=960)  # ten chunks of 96: no remainder after the loop
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    graph, region = _region_along(fun, args, 2, closed)
    from memsafe.split.emit import emit

    emitted = emit(closed, graph, online.plan(graph, region), 96)
    top = [e.primitive.name for e in emitted.jaxpr.eqns]
    before = set(top[: top.index("scan")])  # a chunk body runs under jax.checkpoint
    assert top.count("scan") == 1 and not before & {"dot_general", "remat2", "checkpoint"}, top
    _close(jax.jit(jaxpr_as_fun(emitted))(*args)[0], jax.jit(fun)(*args))


# -- issue 6: attention at sequence length 32,768 under 2 GiB -------------------------------


def _attention_example():
    from examples import attention as ex

    return ex


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_attention_equals_jax_jit_at_a_length_that_fits(mode):
    """8 heads, d=64, L=2048 under 64 MiB (jax.jit: 272 MiB forward, 536 MiB backward)."""
    ex = _attention_example()
    q, k, v = ex.make_inputs(8, 2048, 64)
    fun = ex.attention if mode == "forward" else ex.attention_value_and_grad
    limit = 64 * 2**20
    f = memsafe.jit(fun, memory_limit=limit)
    _fits(f, (q, k, v), limit)
    _close(f(q, k, v), jax.jit(fun)(q, k, v), tol=5e-5)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["forward", "backward"])
def test_attention_32k_under_2gib(mode):
    """L=32,768, 8 heads, d=64: the scores alone are 32 GiB; forward and forward+backward run
    under 2 GiB (XLA's buffer assignment). The forward output is checked on sampled rows against
    float64 NumPy; the backward's loss against the forward's. Minutes on 2 cores."""
    ex = _attention_example()
    q, k, v = ex.make_inputs(8, 32_768, 64)
    limit = 2 * 2**30
    fun = ex.attention if mode == "forward" else ex.attention_value_and_grad
    f = memsafe.jit(fun, memory_limit=limit)
    plan = _fits(f, (q, k, v), limit)
    assert plan.before.total > 16 * limit
    out = f(q, k, v)
    if mode == "forward":
        rows = np.arange(0, 32_768, 2048)
        ref = ex.reference(q, k, v, False, rows)
        np.testing.assert_allclose(np.asarray(out)[:, rows], ref, atol=1e-5, rtol=1e-4)
    else:
        loss, grads = out
        fwd = memsafe.jit(ex.attention, memory_limit=limit)(q, k, v)
        np.testing.assert_allclose(float(loss), 0.5 * float(jnp.sum(fwd**2)), rtol=1e-5)
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
