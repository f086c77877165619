"""Sparse Gaussian process regression (SGPR, Titsias 2009), written as a user writes it in JAX.

The collapsed evidence lower bound is computed the way GPflow's ``SGPR.elbo`` computes it
(Cholesky of Kuu + jitter, A = L^-1 Kuf / sigma, B = I + A A^T, ...), with a squared-exponential
kernel with ARD lengthscales written by broadcasting. Parameters are a dict of constrained values:
``variance`` (), ``lengthscales`` (D,) or (), ``noise`` () and inducing points ``Z`` (M, D).
With N data points and M inducing points, Kuf and A are M x N: at N=434,874 and M=2,000 (the
size of UCI's 3droad) each is 7 GB in float64.

Use float64 (``with jax.enable_x64(True):``), as GPflow does.

Run as a script: ``python -m examples.sgpr --N 20000 --M 200 --limit 512MiB``.
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.scipy.linalg import solve_triangular

#: GPflow's default jitter, added to the diagonal of Kuu before its Cholesky factorisation.
JITTER = 1e-6

Params = dict[str, jax.Array]


def se_kernel(x1: jax.Array, x2: jax.Array, variance: jax.Array, lengthscales: jax.Array):
    """Squared-exponential kernel matrix k(x1, x2), (n1, n2), written by broadcasting."""
    diff = (x1[:, None, :] - x2[None, :, :]) / lengthscales
    return variance * jnp.exp(-0.5 * jnp.sum(diff**2, axis=-1))


def _common(params: Params, x: jax.Array, jitter: float):
    """The matrices the bound and the predictions share: L, A, AAT, LB."""
    z, variance, ls = params["Z"], params["variance"], params["lengthscales"]
    m = z.shape[0]
    kuu = se_kernel(z, z, variance, ls) + jitter * jnp.eye(m, dtype=z.dtype)
    kuf = se_kernel(z, x, variance, ls)
    chol = jnp.linalg.cholesky(kuu)
    sigma = jnp.sqrt(params["noise"])
    a = solve_triangular(chol, kuf, lower=True) / sigma
    aat = a @ a.T
    chol_b = jnp.linalg.cholesky(jnp.eye(m, dtype=z.dtype) + aat)
    return chol, a, aat, chol_b, sigma


def sgpr_elbo(params: Params, x: jax.Array, y: jax.Array, jitter: float = JITTER) -> jax.Array:
    """The collapsed lower bound on log p(y) (Titsias 2009), as GPflow's SGPR computes it."""
    n, p = y.shape
    noise = params["noise"]
    _, a, aat, chol_b, sigma = _common(params, x, jitter)
    c = solve_triangular(chol_b, a @ y, lower=True) / sigma
    kdiag = jnp.full((n,), params["variance"], dtype=x.dtype)
    trace = jnp.sum(kdiag) / noise - jnp.trace(aat)
    bound = -0.5 * n * p * math.log(2 * math.pi)
    bound -= p * jnp.sum(jnp.log(jnp.diag(chol_b)))
    bound -= 0.5 * n * p * jnp.log(noise)
    bound -= 0.5 * jnp.sum(y**2) / noise
    bound += 0.5 * jnp.sum(c**2)
    bound -= 0.5 * p * trace
    return bound


#: The bound and its gradient with respect to every parameter (variance, lengthscales, noise, Z).
sgpr_elbo_and_grad = jax.value_and_grad(sgpr_elbo)


def sgpr_predict(
    params: Params, x: jax.Array, y: jax.Array, xnew: jax.Array, jitter: float = JITTER
) -> tuple[jax.Array, jax.Array]:
    """Predictive mean and marginal variance of f at ``xnew``, as GPflow's ``SGPR.predict_f``."""
    chol, a, _, chol_b, sigma = _common(params, x, jitter)
    c = solve_triangular(chol_b, a @ y, lower=True) / sigma
    kus = se_kernel(params["Z"], xnew, params["variance"], params["lengthscales"])
    tmp1 = solve_triangular(chol, kus, lower=True)
    tmp2 = solve_triangular(chol_b, tmp1, lower=True)
    mean = tmp2.T @ c
    var = params["variance"] + jnp.sum(tmp2**2, axis=0) - jnp.sum(tmp1**2, axis=0)
    return mean, jnp.broadcast_to(var[:, None], mean.shape)


# -- training --------------------------------------------------------------------------------


def _softplus_inverse(v: jax.Array) -> jax.Array:
    return v + jnp.log(-jnp.expm1(-v))


def constrain(raw: Params) -> Params:
    """Positive parameters through softplus (GPflow's default transform); Z unconstrained."""
    return {k: (v if k == "Z" else jax.nn.softplus(v)) for k, v in raw.items()}


def unconstrain(params: Params) -> Params:
    return {k: (v if k == "Z" else _softplus_inverse(v)) for k, v in params.items()}


def train(
    params: Params,
    x: jax.Array,
    y: jax.Array,
    steps: int = 100,
    method: str = "lbfgs",
    memory_limit: int | str | None = None,
    learning_rate: float = 0.05,
) -> tuple[Params, list[float]]:
    """Maximise the bound over all parameters (softplus-constrained), with scipy's L-BFGS-B (as
    GPflow's Scipy optimizer) or optax's Adam. With ``memory_limit`` the loss and its gradient run
    under memsafe.jit. Returns the trained parameters and the bound after each evaluation."""
    from jax.flatten_util import ravel_pytree

    def loss(raw: Params, x: jax.Array, y: jax.Array) -> jax.Array:
        return -sgpr_elbo(constrain(raw), x, y)

    if memory_limit is None:
        step_fn: Callable[..., Any] = jax.jit(jax.value_and_grad(loss))
    else:
        import memsafe

        step_fn = memsafe.jit(jax.value_and_grad(loss), memory_limit=memory_limit)
    raw0 = unconstrain(params)
    history: list[float] = []
    if method == "lbfgs":
        import scipy.optimize

        flat0, unravel = ravel_pytree(raw0)

        def fun(theta: np.ndarray) -> tuple[float, np.ndarray]:
            value, grad = step_fn(unravel(jnp.asarray(theta, flat0.dtype)), x, y)
            history.append(-float(value))
            return float(value), np.asarray(ravel_pytree(grad)[0], np.float64)

        result = scipy.optimize.minimize(
            fun,
            np.asarray(flat0, np.float64),
            jac=True,
            method="L-BFGS-B",
            options={"maxiter": steps},
        )
        return constrain(unravel(jnp.asarray(result.x, flat0.dtype))), history
    if method == "adam":
        import optax

        opt = optax.adam(learning_rate)
        raw, state = raw0, opt.init(raw0)
        for _ in range(steps):
            value, grad = step_fn(raw, x, y)
            history.append(-float(value))
            updates, state = opt.update(grad, state)
            raw = optax.apply_updates(raw, updates)
        return constrain(raw), history
    raise ValueError(f"unknown training method {method!r}; expected 'lbfgs' or 'adam'")


# -- data ------------------------------------------------------------------------------------


def make_data(
    n: int, m: int, d: int = 3, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Synthetic regression data shaped like UCI 3droad (N x 3 inputs, one output), float64.

    Inputs are uniform in [0, 1]^d (standardised coordinates); the output is a smooth function
    plus Gaussian noise, standardised. Inducing points are ``m`` distinct rows of ``x``.
    """
    rng = np.random.default_rng(seed)
    x = rng.uniform(0.0, 1.0, (n, d))
    w = np.arange(1, d + 1, dtype=np.float64)
    f = np.sin(3.0 * x @ w) + 0.5 * np.cos(5.0 * x[:, 0]) * x[:, -1]
    y = f + 0.1 * rng.standard_normal(n)
    y = ((y - y.mean()) / y.std())[:, None]
    z = x[rng.choice(n, size=m, replace=False)].copy()
    return x, y, z


def default_params(z: np.ndarray, d: int) -> dict[str, np.ndarray]:
    """Hyperparameters the reference data and the benchmarks start from."""
    return {
        "variance": np.asarray(1.3),
        "lengthscales": np.linspace(0.3, 0.6, d),
        "noise": np.asarray(0.1),
        "Z": np.asarray(z),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", type=int, default=20_000)
    parser.add_argument("--M", type=int, default=200)
    parser.add_argument("--D", type=int, default=3)
    parser.add_argument("--limit", default="512MiB", help="memsafe memory limit")
    parser.add_argument("--train-steps", type=int, default=0)
    args = parser.parse_args()

    import memsafe

    with jax.enable_x64(True):
        x, y, z = make_data(args.N, args.M, args.D)
        params = {k: jnp.asarray(v) for k, v in default_params(z, args.D).items()}
        safe = memsafe.jit(sgpr_elbo_and_grad, memory_limit=args.limit)
        print(safe.plan(params, x, y))
        start = time.perf_counter()
        value, _ = jax.block_until_ready(safe(params, x, y))
        print(
            f"bound {float(value):.6f}; value and gradient in {time.perf_counter() - start:.2f} s"
        )
        if args.train_steps:
            trained, history = train(params, x, y, args.train_steps, memory_limit=args.limit)
            print(f"bound after training: {history[-1]:.6f}")
            mean, var = sgpr_predict(trained, x, y, x[:5])
            print("predictive mean", np.asarray(mean[:, 0]), "variance", np.asarray(var[:, 0]))


if __name__ == "__main__":
    main()
