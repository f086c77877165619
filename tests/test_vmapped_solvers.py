"""Batches of solver problems under ``jax.vmap`` (issue 41): a while loop whose predicate is
batched along the problems (each stops at its own iteration) and whose body reads a large matrix
built outside the loop (a kernel matrix per problem for conjugate gradients, a cost matrix per
problem for Sinkhorn). The matrix is recomputed in chunks inside the loop, as for one problem; the
loop is bound again in the batched-predicate form ``jax.vmap`` gave it (``lax.while_loop`` takes
scalar predicates only), so each problem runs jax.jit's iterations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe._jax import ClosedJaxpr
from memsafe.graph import evaluate
from memsafe.rewrite import invariants
from tests.limits import limit_between, plan_fitting


def _kernel(x: jax.Array) -> jax.Array:
    """A Gaussian kernel matrix with a ridge (condition number about 10)."""
    sq = jnp.sum(x * x, -1)
    d2 = jnp.maximum(sq[:, None] + sq[None, :] - 2 * x @ x.T, 0)
    return jnp.exp(-d2) + 0.05 * x.shape[0] * jnp.eye(x.shape[0], dtype=x.dtype)


def _cg(k: jax.Array, b: jax.Array, tol: float = 1e-4, most: int = 60) -> tuple:
    """Conjugate gradients until the residual is under ``tol`` relative to ``b``: the
    solution and the iterations it took."""
    bb = jnp.dot(b, b)

    def keep_going(s):
        it, _, _, _, rr = s
        return (it < most) & (rr > tol**2 * bb)

    def step(s):
        it, a, r, p, rr = s
        kp = k @ p
        alpha = rr / jnp.dot(p, kp)
        a, r = a + alpha * p, r - alpha * kp
        new = jnp.dot(r, r)
        return it + 1, a, r, r + new / rr * p, new

    it, a, *_ = lax.while_loop(keep_going, step, (0, jnp.zeros_like(b), b, b, bb))
    return a, it


def _ridge(x: jax.Array, t: jax.Array) -> tuple:
    a, it = _cg(_kernel(x), t)
    return jnp.dot(a, t), it


def _problems(batch: int = 4, n: int = 512, d: int = 3) -> tuple[jax.Array, jax.Array]:
    xs = jax.random.normal(jax.random.key(0), (batch, n, d))
    ts = jax.random.normal(jax.random.key(1), (batch, n))
    return xs, ts


def _same_trips(fun, limit: int, args, at: int) -> None:
    """The iteration counts (result ``at``) equal jax.jit's, position by position."""
    got = memsafe.jit(fun, memory_limit=limit)(*args)[at]
    want = jax.jit(fun)(*args)[at]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_vmapped_conjugate_gradient_recomputes_its_kernel_matrices_inside_the_loop():
    """Four kernel systems of 512 under ``jax.vmap``: the [4, 512, 512] kernel matrices every
    iteration reads are made in chunks inside the batched loop."""
    fun = jax.vmap(_ridge)
    args = _problems()
    plan = plan_fitting(fun, args)
    assert any(r.data.get("loop") == "while" for r in plan.passes), plan
    _same_trips(fun, limit_between(fun, args, 0.25), args, 1)


def test_jax_scipy_cg_under_vmap_fits():
    """``jax.scipy.sparse.linalg.cg`` as its users call it, over a batch of systems."""

    def solve(x, t):
        k = _kernel(x)
        a, _ = jax.scipy.sparse.linalg.cg(lambda v: k @ v, t, tol=1e-4, maxiter=60)
        return jnp.dot(a, t)

    plan_fitting(jax.vmap(solve), _problems())


def _sinkhorn(x: jax.Array, y: jax.Array, eps: float = 0.5, tol: float = 1e-3) -> tuple:
    """Sinkhorn's scalings between uniform clouds, the Gibbs kernel ``exp(-cost / eps)`` built
    once outside the loop and read by products along both axes, until the row marginals' error
    is under ``tol``: the transport cost and the sweeps."""
    c = jnp.sum(x * x, -1)[:, None] + jnp.sum(y * y, -1)[None, :] - 2 * x @ y.T
    k = jnp.exp(-c / eps)
    a = jnp.full(x.shape[0], 1 / x.shape[0])
    b = jnp.full(y.shape[0], 1 / y.shape[0])

    def keep_going(s):
        return (s[0] < 200) & (s[3] > tol)

    def sweep(s):
        it, _, v, _ = s
        u = a / (k @ v)
        v = b / (k.T @ u)
        return it + 1, u, v, jnp.sum(jnp.abs(u * (k @ v) - a))

    init = (0, a, jnp.ones_like(b), jnp.asarray(jnp.inf, x.dtype))
    it, u, v, _ = lax.while_loop(keep_going, sweep, init)
    return jnp.dot(u, (k * c) @ v), it


def test_a_vmapped_sinkhorn_recomputes_its_kernels_inside_the_loop():
    """Three transport problems of 512 x 384 points, each stopping at its own tolerance."""
    xs = 0.5 * jax.random.normal(jax.random.key(2), (3, 512, 3))
    ys = 0.4 * jax.random.normal(jax.random.key(3), (3, 384, 3)) + 0.2
    fun = jax.vmap(_sinkhorn)
    plan = plan_fitting(fun, (xs, ys))
    assert any(r.data.get("loop") == "while" for r in plan.passes), plan
    _same_trips(fun, limit_between(fun, (xs, ys), 0.25), (xs, ys), 1)


@pytest.mark.slow
def test_the_gradient_of_a_vmapped_conjugate_gradient_fits():
    """The gradient through ``jax.scipy.sparse.linalg.cg`` (``custom_linear_solve``: its
    backward solves again) over a batch of systems, w.r.t. the points."""

    def loss(xs, ts):
        def solve(x, t):
            k = _kernel(x)
            a, _ = jax.scipy.sparse.linalg.cg(lambda v: k @ v, t, tol=1e-4, maxiter=60)
            return jnp.dot(a, t)

        return jnp.sum(jax.vmap(solve)(xs, ts))

    plan_fitting(jax.grad(loss), _problems(batch=2, n=384))


def test_moving_an_invariant_into_a_batched_loop_keeps_its_predicate_batched():
    """The invariant transform binds a batched-predicate loop in the same form, with the
    matrix it moved recomputed inside the body, and computes the same values."""
    args = _problems(batch=3, n=160)
    closed = jax.make_jaxpr(jax.vmap(_ridge))(*args)
    moving = invariants.Moving(0, invariants.UNHELD, whiles=True)
    records: list = []
    new = invariants.transform(closed, records, moving=moving)
    assert records and records[0].data["loop"] == "while", records
    (loop,) = [e for e in new.jaxpr.eqns if e.primitive.name == "while"]
    assert loop.params["cond_jaxpr"].out_avals[0].shape == (3,)
    big = [v for v in loop.invars if getattr(v.aval, "shape", ()) == (3, 160, 160)]
    assert not big, "the kernel matrices are still an operand of the loop"
    want = evaluate(closed, list(args))
    got = evaluate(ClosedJaxpr(new.jaxpr, new.consts), list(args))
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
