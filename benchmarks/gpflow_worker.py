"""GPflow's SGPR, run inside its own environment (benchmarks/.envs/gpflow): no JAX here.

GPflow 2.11 needs TensorFlow and NumPy < 2, which cannot share an environment with JAX 0.10 and
NumPy 2, so ``benchmarks.gpflow_env`` runs this file as a subprocess::

    python gpflow_worker.py REQUEST.json RESULT.json

The request names an ``.npz`` with ``x`` (N, D), ``y`` (N, 1), ``Z`` (M, D), ``variance``,
``lengthscales``, ``noise`` (and optionally ``xnew``) and a ``mode``:

- ``reference``: the bound, its gradient with respect to the constrained parameters (variance,
  lengthscales, noise, Z) and, with ``xnew``, the predictive mean and variance;
- ``bench``: times of ``what`` (``bound`` or ``grad``) under ``tf.function``: the first call
  (tracing included) and ``repeats`` more, with the process's peak RSS.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import gpflow
import numpy as np
import tensorflow as tf


def build_model(data: dict[str, np.ndarray]) -> gpflow.models.SGPR:
    """An SGPR whose parameters are untransformed, so that gradients are with respect to the
    constrained values (the same quantities the JAX example differentiates)."""
    kernel = gpflow.kernels.SquaredExponential()
    kernel.variance = gpflow.Parameter(data["variance"], transform=None)
    kernel.lengthscales = gpflow.Parameter(data["lengthscales"], transform=None)
    model = gpflow.models.SGPR((data["x"], data["y"]), kernel, inducing_variable=data["Z"])
    model.likelihood.variance = gpflow.Parameter(data["noise"], transform=None)
    return model


def _variables(model: gpflow.models.SGPR) -> dict[str, tf.Variable]:
    return {
        "variance": model.kernel.variance.unconstrained_variable,
        "lengthscales": model.kernel.lengthscales.unconstrained_variable,
        "noise": model.likelihood.variance.unconstrained_variable,
        "Z": model.inducing_variable.Z.unconstrained_variable,
    }


def bound_and_grad(model: gpflow.models.SGPR) -> tuple[tf.Tensor, dict[str, tf.Tensor]]:
    variables = _variables(model)
    with tf.GradientTape() as tape:
        bound = model.elbo()
    grads = tape.gradient(bound, variables)
    return bound, grads


def reference(data: dict[str, np.ndarray]) -> dict:
    model = build_model(data)
    bound, grads = bound_and_grad(model)
    out: dict = {
        "bound": float(bound.numpy()),
        "grad": {k: np.asarray(v.numpy()).tolist() for k, v in grads.items()},
    }
    if "xnew" in data:
        mean, var = model.predict_f(data["xnew"])
        out["predict_mean"] = np.asarray(mean.numpy()).tolist()
        out["predict_var"] = np.asarray(var.numpy()).tolist()
    return out


def bench(data: dict[str, np.ndarray], what: str, repeats: int) -> dict:
    model = build_model(data)
    if what == "bound":
        fun = tf.function(model.elbo)
    elif what == "grad":
        fun = tf.function(lambda: bound_and_grad(model))
    else:
        raise ValueError(f"unknown benchmark {what!r}; expected 'bound' or 'grad'")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    start = time.perf_counter()
    result = fun()
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fun()
        _ = (result[0] if what == "grad" else result).numpy()
        times.append(time.perf_counter() - start)
    value = result[0] if what == "grad" else result
    return {
        "first_call_s": first,
        "times_s": times,
        "bound": float(value.numpy()),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_before_bytes": rss_before,
        "versions": {"gpflow": gpflow.__version__, "tensorflow": tf.__version__},
    }


def main() -> None:
    request_path, result_path = sys.argv[1], sys.argv[2]
    with open(request_path) as fh:
        request = json.load(fh)
    with np.load(request["data"]) as npz:
        data = {k: np.asarray(npz[k], np.float64) for k in npz.files}
    if request["mode"] == "reference":
        result = reference(data)
    elif request["mode"] == "bench":
        result = bench(data, request["what"], int(request.get("repeats", 3)))
    else:
        raise ValueError(f"unknown mode {request['mode']!r}; expected 'reference' or 'bench'")
    result["versions"] = {"gpflow": gpflow.__version__, "tensorflow": tf.__version__}
    with open(result_path, "w") as fh:
        json.dump(result, fh)


if __name__ == "__main__":
    main()
