"""SGPR example against GPflow 2.11.2's values (tests/data, made by benchmarks/sgpr_reference.py):
the bound, its gradient with respect to every parameter and the predictions, to 1e-8 relative,
under jax.jit and under memsafe.jit."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.scipy.linalg import solve_triangular

import memsafe
from examples import sgpr

DATA = Path(__file__).parent / "data"
RTOL = 1e-8
#: The same bound computed in different chunks differs by rounding amplified by cond(Kuu + jitter)
#: (9e8 at M=2,000): memsafe against plain jax.jit at N=20k, M=2,000 differed by 1e-13 (value),
#: 2e-11 (hyperparameter gradients) and 5e-7 (Z gradient, max-norm relative).
RTOL_BLOCKS = {"value": 1e-10, "variance": 1e-8, "lengthscales": 1e-8, "noise": 1e-8, "Z": 1e-5}


@pytest.fixture(scope="module")
def reference():
    ref = json.loads((DATA / "sgpr_gpflow_reference.json").read_text())
    with np.load(DATA / "sgpr_inputs.npz") as npz:
        data = {k: npz[k] for k in npz.files}
    return ref, data


def _params(data):
    return {k: jnp.asarray(data[k]) for k in ("variance", "lengthscales", "noise", "Z")}


def _assert_close(got, want, rtol=RTOL):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = np.max(np.abs(want))
    err = np.max(np.abs(got - want)) / scale
    assert err <= rtol, f"relative error {err:.3e} > {rtol:.0e}"


def test_inputs_follow_the_recipe(reference):
    ref, data = reference
    r = ref["recipe"]
    x, y, z = sgpr.make_data(r["N"], r["M"], r["D"], r["seed"])
    np.testing.assert_array_equal(x, data["x"])
    np.testing.assert_array_equal(y, data["y"])
    np.testing.assert_array_equal(z, data["Z"])
    assert ref["jitter"] == sgpr.JITTER


@pytest.mark.parametrize("runner", ["jax", "memsafe"])
def test_bound_and_gradients_equal_gpflow(reference, runner):
    ref, data = reference
    with jax.enable_x64(True):
        params = _params(data)
        x, y = jnp.asarray(data["x"]), jnp.asarray(data["y"])
        if runner == "jax":
            fun = jax.jit(sgpr.sgpr_elbo_and_grad)
        else:
            fun = memsafe.jit(sgpr.sgpr_elbo_and_grad, memory_limit="1GiB")
        value, grad = fun(params, x, y)
        assert value.dtype == jnp.float64
    _assert_close(value, ref["bound"])
    for name in ("variance", "lengthscales", "noise", "Z"):
        _assert_close(grad[name], ref["grad"][name])


def test_predictions_equal_gpflow(reference):
    ref, data = reference
    with jax.enable_x64(True):
        mean, var = jax.jit(sgpr.sgpr_predict)(
            _params(data), data["x"], data["y"], jnp.asarray(data["xnew"])
        )
    _assert_close(mean, ref["predict_mean"])
    _assert_close(var, ref["predict_var"])


def test_training_raises_the_bound():
    with jax.enable_x64(True):
        x, y, z = sgpr.make_data(400, 15, seed=3)
        params = {k: jnp.asarray(v) for k, v in sgpr.default_params(z, 3).items()}
        start = float(sgpr.sgpr_elbo(params, x, y))
        for method in ("lbfgs", "adam"):
            trained, history = sgpr.train(params, x, y, steps=15, method=method)
            assert history[0] == pytest.approx(start, rel=1e-12)
            assert float(sgpr.sgpr_elbo(trained, x, y)) > start + 10
            assert all(bool(jnp.all(v > 0)) for k, v in trained.items() if k != "Z")
    with pytest.raises(ValueError, match="training method"):
        sgpr.train(params, x, y, method="sgd")


@pytest.mark.parametrize("what", ["bound", "grad"])
def test_sgpr_under_memsafe_limit_equals_jax(what):
    fun = sgpr.sgpr_elbo if what == "bound" else sgpr.sgpr_elbo_and_grad
    with jax.enable_x64(True):
        x, y, z = sgpr.make_data(2000, 50)
        params = {k: jnp.asarray(v) for k, v in sgpr.default_params(z, 3).items()}
        compiled = memsafe.xla.memsafe_jit(fun).lower(params, x, y).compile()
        limit = memsafe.Footprint.from_compiled(compiled).total // 5
        safe = memsafe.jit(fun, memory_limit=limit)
        out = safe(params, x, y)
        assert safe.plan(params, x, y).after.total <= limit
        ref = jax.jit(fun)(params, x, y)
    jax.tree_util.tree_map(lambda a, b: _assert_close(a, b, 1e-10), out, ref)


def test_sgpr_predictions_under_memsafe_limit_equal_jax():
    """Predictions at more test points than data: Kus and its two triangular solves are split
    along the test points, Kuf along the data."""
    with jax.enable_x64(True):
        x, y, z = sgpr.make_data(2000, 40, seed=5)
        params = {k: jnp.asarray(v) for k, v in sgpr.default_params(z, 3).items()}
        xnew = jnp.asarray(np.random.default_rng(6).uniform(0, 1, (3000, 3)))
        args = (params, x, y, xnew)
        compiled = memsafe.xla.memsafe_jit(sgpr.sgpr_predict).lower(*args).compile()
        limit = memsafe.Footprint.from_compiled(compiled).total // 4
        safe = memsafe.jit(sgpr.sgpr_predict, memory_limit=limit)
        out = safe(*args)
        plan = safe.plan(*args)
        assert len(plan.splits) >= 2 and plan.after.total <= limit, plan
        ref = jax.jit(sgpr.sgpr_predict)(*args)
    jax.tree_util.tree_map(lambda a, b: _assert_close(a, b, 1e-10), out, ref)


def _bound_in_blocks(params, x, y, chunk=16_384, jitter=sgpr.JITTER):
    """The same bound evaluated by a hand-chunked program: A = L^-1 Kuf / sigma is formed one
    block of data at a time (a checkpointed scan plus the remainder), accumulating A A^T and A y,
    then only M x M algebra. The association matches the example's (A A^T from A, not
    L^-1 (Kuf Kuf^T) L^-T, whose rounding grows with cond(Kuu) N: 6e-6 relative at 3droad
    scale), so it is a reference at scales plain jax.jit cannot hold."""
    z, var, ls, noise = params["Z"], params["variance"], params["lengthscales"], params["noise"]
    n, m = x.shape[0], z.shape[0]
    eye = jnp.eye(m, dtype=x.dtype)
    chol = jnp.linalg.cholesky(sgpr.se_kernel(z, z, var, ls) + jitter * eye)
    sigma = jnp.sqrt(noise)

    @jax.checkpoint
    def stats(xb, yb):
        a = solve_triangular(chol, sgpr.se_kernel(z, xb, var, ls), lower=True) / sigma
        return a @ a.T, a @ yb

    full = (n // chunk) * chunk

    def step(acc, block):
        aa, ay = stats(*block)
        return (acc[0] + aa, acc[1] + ay), None

    zero = (jnp.zeros((m, m), x.dtype), jnp.zeros((m, y.shape[1]), x.dtype))
    blocks = (x[:full].reshape(-1, chunk, x.shape[1]), y[:full].reshape(-1, chunk, y.shape[1]))
    (aat, ay), _ = jax.lax.scan(step, zero, blocks)
    if full < n:
        ra, ry = stats(x[full:], y[full:])
        aat, ay = aat + ra, ay + ry
    chol_b = jnp.linalg.cholesky(eye + aat)
    c = solve_triangular(chol_b, ay, lower=True) / sigma
    p = y.shape[1]
    bound = -0.5 * n * p * np.log(2 * np.pi) - p * jnp.sum(jnp.log(jnp.diag(chol_b)))
    bound -= 0.5 * n * p * jnp.log(noise) + 0.5 * jnp.sum(y**2) / noise
    bound += 0.5 * jnp.sum(c**2) - 0.5 * p * (n * var / noise - jnp.trace(aat))
    return bound


def test_bound_in_blocks_equals_the_example():
    with jax.enable_x64(True):
        x, y, z = sgpr.make_data(5000, 60, seed=7)
        params = {k: jnp.asarray(v) for k, v in sgpr.default_params(z, 3).items()}
        got = jax.jit(jax.value_and_grad(lambda p: _bound_in_blocks(p, x, y, 1024)))(params)
        want = jax.jit(sgpr.sgpr_elbo_and_grad)(params, x, y)
    _assert_close(got[0], want[0], RTOL_BLOCKS["value"])
    for name in ("variance", "lengthscales", "noise", "Z"):
        _assert_close(got[1][name], want[1][name], RTOL_BLOCKS[name])


@pytest.mark.slow
def test_sgpr_3droad_scale_under_4gib():
    """UCI 3droad's shape (N=434,874, D=3, synthetic), M=2,000: Kuf and A are 7 GB each, plain
    jax.jit needs 13 GiB for the bound and 58.5 GiB with the gradient. Under a 4 GiB limit the
    bound and gradient equal a hand-chunked evaluation."""
    limit = 4 * 2**30
    with jax.enable_x64(True):
        x, y, z = sgpr.make_data(434_874, 2000)
        params = {k: jnp.asarray(v) for k, v in sgpr.default_params(z, 3).items()}
        x, y = jnp.asarray(x), jnp.asarray(y)
        bound_fn = memsafe.jit(sgpr.sgpr_elbo, memory_limit=limit)
        grad_fn = memsafe.jit(sgpr.sgpr_elbo_and_grad, memory_limit=limit)
        for fn in (bound_fn, grad_fn):
            plan = fn.plan(params, x, y)
            assert plan.splits and plan.before.total > 3 * limit, plan
            assert plan.after.total <= limit, plan
        bound = bound_fn(params, x, y)
        value, grad = grad_fn(params, x, y)
        ref_value, ref_grad = jax.jit(jax.value_and_grad(lambda p: _bound_in_blocks(p, x, y)))(
            params
        )
    _assert_close(value, bound, 1e-11)  # the same bound, split into different chunks
    _assert_close(bound, ref_value, RTOL_BLOCKS["value"])
    for name in ("variance", "lengthscales", "noise", "Z"):
        _assert_close(grad[name], ref_grad[name], RTOL_BLOCKS[name])
