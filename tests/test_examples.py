"""The workloads (examples/) against exact float64 references, and under memsafe.jit at small
sizes with limits well below what jax.jit needs: same answers, verified footprints."""

from __future__ import annotations

import functools

import jax
import jax.test_util
import numpy as np
import pytest

import memsafe
from examples import attention, hutchinson, kernel_matvec, knn, sinkhorn


def _need(fun, *args) -> int:
    """jax.jit's compiled footprint (memsafe's accounting) for ``fun`` at ``args``."""
    compiled = memsafe.xla.memsafe_jit(fun).lower(*args).compile()
    return memsafe.Footprint.from_compiled(compiled).total


# -- kNN -------------------------------------------------------------------------------------


@pytest.mark.parametrize("metric", knn.METRICS)
def test_knn_matches_exact_reference(metric):
    x, y = knn.make_inputs(64, 3000, 8)
    dist, idx = jax.jit(knn.FUNCTIONS[metric], static_argnames="k")(x, y, k=5)
    assert dist.shape == idx.shape == (64, 5)
    err = knn.neighbour_errors(x, y, metric, np.asarray(dist), np.asarray(idx), np.arange(64))
    assert err["recall"] == 1.0
    assert err["max_abs_distance_error"] < 1e-4
    assert np.all(np.diff(np.asarray(dist), axis=1) >= 0)  # nearest first


@pytest.mark.parametrize("metric", knn.METRICS)
def test_knn_under_memsafe_limit(metric):
    x, y = knn.make_inputs(256, 20_000, 8, seed=1)
    fun = functools.partial(knn.FUNCTIONS[metric], k=10)
    need = _need(fun, x, y)
    limit = need // 8
    safe = memsafe.jit(fun, memory_limit=limit)
    dist, idx = safe(x, y)
    plan = safe.plan(x, y)
    assert not plan.fits_unchanged and plan.after.total <= limit
    rows = np.arange(0, 256, 4)
    err = knn.neighbour_errors(x, y, metric, np.asarray(dist), np.asarray(idx), rows)
    assert err["recall"] == 1.0
    assert err["max_abs_distance_error"] < 1e-4


def test_knn_reference_rejects_unknown_metric():
    with pytest.raises(ValueError, match="unknown metric"):
        knn.reference_distances(np.ones((2, 2)), np.ones((3, 2)), "hamming")


# -- Gaussian kernel matvec --------------------------------------------------------------------


@pytest.mark.parametrize("p", [None, 3])
def test_kernel_matvec_matches_reference(p):
    x, y, v = kernel_matvec.make_inputs(300, 500, 3, p=p)
    out = jax.jit(kernel_matvec.gaussian_kernel_matvec)(x, y, v, 0.5)
    assert out.shape == ((300,) if p is None else (300, p))
    ref = kernel_matvec.reference(x, y, v, 0.5)
    assert kernel_matvec.relative_error(out, ref) < 1e-5


def test_kernel_matvec_under_memsafe_limit():
    x, y, v = kernel_matvec.make_inputs(3000, 3000, 3)
    need = _need(kernel_matvec.gaussian_kernel_matvec, x, y, v, 0.5)
    limit = need // 10
    safe = memsafe.jit(kernel_matvec.gaussian_kernel_matvec, memory_limit=limit)
    out = safe(x, y, v, 0.5)
    assert safe.plan(x, y, v, 0.5).after.total <= limit
    rows = np.arange(0, 3000, 30)
    ref = kernel_matvec.reference(x, y, v, 0.5, rows)
    assert kernel_matvec.relative_error(np.asarray(out)[rows], ref) < 1e-5


# -- attention -------------------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_reference(causal):
    q, k, v = attention.make_inputs(2, 96, 16)
    out = jax.jit(attention.attention, static_argnames="causal")(q, k, v, causal=causal)
    rows = np.arange(96)
    np.testing.assert_allclose(out, attention.reference(q, k, v, causal, rows), atol=1e-5)


def test_attention_gradient_matches_finite_differences():
    q, k, v = (a.astype(np.float64) for a in attention.make_inputs(1, 8, 4))
    with jax.enable_x64(True):
        jax.test_util.check_grads(
            functools.partial(attention.attention_loss, causal=True),
            (q, k, v),
            order=1,
            modes=["rev"],
        )


def test_multihead_attention_shapes_and_heads():
    params = attention.init_projections(jax.random.PRNGKey(0), 32, 4)
    x = jax.random.normal(jax.random.PRNGKey(1), (10, 32))
    out = attention.multihead_attention(params, x, heads=4, causal=True)
    assert out.shape == (10, 32)
    # Causal: the first position's output depends only on the first input.
    x2 = x.at[5:].set(0.0)
    out2 = attention.multihead_attention(params, x2, heads=4, causal=True)
    np.testing.assert_allclose(out[:5], out2[:5], atol=1e-5)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_forward_under_memsafe_limit(causal):
    q, k, v = attention.make_inputs(2, 1024, 16)
    fun = functools.partial(attention.attention, causal=causal)
    need = _need(fun, q, k, v)
    limit = need // 4
    safe = memsafe.jit(fun, memory_limit=limit)
    out = safe(q, k, v)
    assert safe.plan(q, k, v).after.total <= limit
    rows = np.arange(0, 1024, 16)
    ref = attention.reference(q, k, v, causal, rows)
    np.testing.assert_allclose(np.asarray(out)[:, rows], ref, atol=1e-5)


def test_attention_backward_under_memsafe_limit():
    q, k, v = attention.make_inputs(2, 1024, 16, seed=2)
    fun = functools.partial(attention.attention_value_and_grad, causal=False)
    need = _need(fun, q, k, v)
    limit = need // 4
    safe = memsafe.jit(fun, memory_limit=limit)
    loss, grads = safe(q, k, v)
    assert safe.plan(q, k, v).after.total <= limit
    ref_loss, ref_grads = jax.jit(fun)(q, k, v)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


# -- Hutchinson ------------------------------------------------------------------------------


def test_hutchinson_forms_agree_and_memsafe_footprint_no_larger():
    inputs = hutchinson.make_inputs(4, 50, 2, 32)
    tiled = jax.jit(hutchinson.traces_tiled)(*inputs)
    broadcast = jax.jit(hutchinson.traces_broadcast)(*inputs)
    np.testing.assert_allclose(tiled, broadcast, rtol=1e-5, atol=1e-6)
    need = _need(hutchinson.traces_tiled, *inputs)
    safe = memsafe.jit(hutchinson.traces_tiled, memory_limit=need)
    np.testing.assert_allclose(safe(*inputs), tiled, rtol=1e-5, atol=1e-6)
    assert safe.plan(*inputs).after.total <= need


def test_sinkhorn_under_memsafe_limit():
    """The cost matrix every iteration reads is made inside the loop, chunk by chunk."""
    x, y = sinkhorn.make_inputs(1500, 1000)
    need = _need(sinkhorn.sinkhorn, x, y)
    limit = need // 4
    safe = memsafe.jit(sinkhorn.sinkhorn, memory_limit=limit)
    plan = safe.plan(x, y)
    assert plan.splits and plan.after.total <= limit, plan
    want = sinkhorn.reference(x, y)
    assert sinkhorn.max_error(safe(x, y), want) < 1e-5
