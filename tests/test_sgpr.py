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

import memsafe
from examples import sgpr

DATA = Path(__file__).parent / "data"
RTOL = 1e-8


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
