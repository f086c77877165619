"""Iterative solvers written the way libraries and users write them (issue 41).

Entropic optimal transport (Sinkhorn in a ``while_loop`` with a convergence test every few
iterations, its value and gradient by the envelope theorem and by implicit differentiation), a
neural ODE loss gradient through a solver with a checkpointed adjoint inside ``custom_vjp`` (fixed
steps and adaptive, ``vmap`` over trajectories), a bounded adaptive solver (``scan`` of
checkpointed steps, finished ones masked) under ``vmap``, and conjugate gradients on a kernel
matrix. Each builder returns ``(fun, args)``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

Program = tuple[Callable[..., Any], tuple[Any, ...]]


# --- entropic optimal transport ------------------------------------------------------------------


def _sqdist(x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum((x[:, None] - y[None]) ** 2, -1)


def sinkhorn_solve(
    c: jax.Array, eps: float = 0.5, tol: float = 1e-4, every: int = 10, most: int = 200
) -> tuple[jax.Array, jax.Array]:
    """Log-domain Sinkhorn potentials for uniform marginals: ``every`` updates per iteration of a
    ``while_loop``, then the row marginal's error; stops under ``tol`` or after ``most`` updates."""
    n, m = c.shape
    la, lb = -jnp.log(n) * jnp.ones(n), -jnp.log(m) * jnp.ones(m)

    def update(_: Any, fg: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        f, g = fg
        f = -eps * jax.nn.logsumexp((g[None] - c) / eps + lb[None], 1)
        g = -eps * jax.nn.logsumexp((f[:, None] - c) / eps + la[:, None], 0)
        return f, g

    def error(f: jax.Array, g: jax.Array) -> jax.Array:
        rows = jnp.exp(jax.nn.logsumexp((f[:, None] + g[None] - c) / eps + lb[None], 1))
        return jnp.sum(jnp.abs(rows - 1.0)) / n

    def cond(s: Any) -> jax.Array:
        i, _, _, err = s
        return (i < most) & (err > tol)

    def body(s: Any) -> Any:
        i, f, g, _ = s
        f, g = lax.fori_loop(0, every, update, (f, g))
        return i + every, f, g, error(f, g)

    start = (0, jnp.zeros(n), jnp.zeros(m), jnp.inf)
    _, f, g, _ = lax.while_loop(cond, body, start)
    return f, g


def _dual(f: jax.Array, g: jax.Array, c: jax.Array, eps: float = 0.5) -> jax.Array:
    """The entropic dual objective with uniform marginals."""
    n, m = c.shape
    p = jnp.exp((f[:, None] + g[None] - c) / eps) / (n * m)
    return jnp.mean(f) + jnp.mean(g) - eps * jnp.sum(p) + eps


def sinkhorn_value(n: int = 2000, m: int = 2500, d: int = 3) -> Program:
    """The regularized transport cost between two point clouds (cost matrix made outside)."""

    def fun(x: jax.Array, y: jax.Array) -> jax.Array:
        c = _sqdist(x, y)
        f, g = sinkhorn_solve(c)
        return _dual(f, g, c)

    return fun, _clouds(n, m, d)


def sinkhorn_envelope(n: int = 2000, m: int = 2500, d: int = 3) -> Program:
    """Value and gradient by the envelope theorem: the potentials are held fixed
    (``stop_gradient``) and the dual differentiated through the cost alone."""

    def cost(x: jax.Array, y: jax.Array) -> jax.Array:
        c = _sqdist(x, y)
        f, g = lax.stop_gradient(sinkhorn_solve(lax.stop_gradient(c)))
        return _dual(f, g, c)

    return jax.value_and_grad(cost, (0, 1)), _clouds(n, m, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def fixed_point(step: Callable[..., Any], c: jax.Array, z0: jax.Array) -> jax.Array:
    """``z = step(c, z)`` by iteration to a tolerance (jaxopt's and ott's implicit form): the
    backward pass solves ``(I - d step/dz)^T u = v`` by another iteration."""
    return _iterate(lambda z: step(c, z), z0)


def _iterate(t: Callable[[jax.Array], jax.Array], z0: jax.Array, tol: float = 1e-4) -> jax.Array:
    def cond(s: Any) -> jax.Array:
        i, _, err = s
        return (i < 100) & (err > tol)

    def body(s: Any) -> Any:
        i, z, _ = s
        new = t(z)
        return i + 1, new, jnp.max(jnp.abs(new - z))

    return lax.while_loop(cond, body, (0, z0, jnp.inf))[1]


def _fixed_fwd(step: Callable[..., Any], c: jax.Array, z0: jax.Array) -> Any:
    z = fixed_point(step, c, z0)
    return z, (c, z)


def _fixed_bwd(step: Callable[..., Any], res: Any, v: jax.Array) -> Any:
    c, z = res
    _, vjp_z = jax.vjp(lambda w: step(c, w), z)
    u = _iterate(lambda u: v + vjp_z(u)[0], v)
    _, vjp_c = jax.vjp(lambda cc: step(cc, z), c)
    return vjp_c(u)[0], jnp.zeros_like(z)


fixed_point.defvjp(_fixed_fwd, _fixed_bwd)


def sinkhorn_implicit(n: int = 2000, m: int = 2500, d: int = 3) -> Program:
    """Value and gradient by implicit differentiation: the row potential is the fixed point of
    one Sinkhorn sweep, differentiated in a ``custom_vjp`` whose backward pass iterates its own
    linear system to a tolerance (in a second ``while_loop``)."""
    eps = 0.5

    def sweep(c: jax.Array, f: jax.Array) -> jax.Array:
        k, l_ = c.shape
        g = -eps * jax.nn.logsumexp((f[:, None] - c) / eps - jnp.log(k), 0)
        f = -eps * jax.nn.logsumexp((g[None] - c) / eps - jnp.log(l_), 1)
        return f - jnp.mean(f)  # the gauge: potentials are defined up to a constant

    def cost(x: jax.Array, y: jax.Array) -> jax.Array:
        c = _sqdist(x, y)
        f = fixed_point(sweep, c, jnp.zeros(c.shape[0]))
        g = -eps * jax.nn.logsumexp((f[:, None] - c) / eps - jnp.log(c.shape[0]), 0)
        return _dual(f, g, c)

    return jax.value_and_grad(cost, (0, 1)), _clouds(n, m, d)


def _clouds(n: int, m: int, d: int) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(41))
    return jax.random.normal(k1, (n, d)), jax.random.normal(k2, (m, d)) * 0.8 + 0.3


# --- neural ODEs ---------------------------------------------------------------------------------


def _field(params: Any, y: jax.Array) -> jax.Array:
    w1, b1, w2 = params
    return jnp.tanh(y @ w1 + b1) @ w2


def _params(d: int, h: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(5))
    return (
        jax.random.normal(k1, (d, h)) / jnp.sqrt(d),
        jnp.zeros(h),
        jax.random.normal(k2, (h, d)) / jnp.sqrt(h),
    )


def _heun(params: Any, y: jax.Array, dt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One Euler-Heun step: the Heun update and its error against Euler's."""
    k1 = _field(params, y)
    k2 = _field(params, y + dt * k1)
    return y + dt * (k1 + k2) / 2, dt * jnp.max(jnp.abs(k2 - k1)) / 2


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def odeint_fixed(params: Any, y0: jax.Array, steps: int) -> jax.Array:
    """Heun's method over ``steps`` fixed steps on [0, 1] in a ``while_loop``: the forward pass
    stores every step's state (the checkpoints), the backward pass runs the steps back in a
    second ``while_loop``, each step's vector-Jacobian product recomputed from its checkpoint."""
    return _fixed_forward(params, y0, steps)[0]


def _fixed_forward(params: Any, y0: jax.Array, steps: int) -> tuple[jax.Array, jax.Array]:
    dt = jnp.asarray(1.0 / steps)

    def body(s: Any) -> Any:
        i, y, ys = s
        ys = ys.at[i].set(y)
        return i + 1, _heun(params, y, dt)[0], ys

    ys = jnp.zeros((steps, *y0.shape), y0.dtype)
    _, y, ys = lax.while_loop(lambda s: s[0] < steps, body, (0, y0, ys))
    return y, ys


def _fixed_fwd(params: Any, y0: jax.Array, steps: int) -> Any:
    y, ys = _fixed_forward(params, y0, steps)
    return y, (params, ys)


def _fixed_bwd_ode(steps: int, res: Any, ybar: jax.Array) -> Any:
    params, ys = res
    dt = jnp.asarray(1.0 / steps)

    def body(s: Any) -> Any:
        i, a, pbar = s
        _, vjp = jax.vjp(lambda p, y: _heun(p, y, dt)[0], params, ys[i])
        dp, dy = vjp(a)
        return i - 1, dy, jax.tree.map(jnp.add, pbar, dp)

    zero = jax.tree.map(jnp.zeros_like, params)
    _, a, pbar = lax.while_loop(lambda s: s[0] >= 0, body, (steps - 1, ybar, zero))
    return pbar, a


odeint_fixed.defvjp(_fixed_fwd, _fixed_bwd_ode)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def odeint_adaptive(params: Any, y0: jax.Array, most: int) -> jax.Array:
    """Adaptive Euler-Heun on [0, 1] to a tolerance, in a ``while_loop`` of at most ``most``
    steps: the forward pass stores the accepted states and step sizes, the backward pass replays
    the accepted steps back from them."""
    return _adaptive_forward(params, y0, most)[0]


def _adaptive_forward(params: Any, y0: jax.Array, most: int) -> Any:
    tol = 1e-3

    def body(s: Any) -> Any:
        i, t, dt, y, ys, dts = s
        dt = jnp.minimum(dt, 1.0 - t)
        new, err = _heun(params, y, dt)
        ok = err <= tol
        ys = jnp.where(ok, ys.at[i].set(y), ys)
        dts = jnp.where(ok, dts.at[i].set(dt), dts)
        grow = jnp.clip(0.9 * jnp.sqrt(tol / jnp.maximum(err, 1e-12)), 0.2, 5.0)
        return (
            i + ok.astype(jnp.int32),
            jnp.where(ok, t + dt, t),
            dt * grow,
            jnp.where(ok, new, y),
            ys,
            dts,
        )

    ys = jnp.zeros((most, *y0.shape), y0.dtype)
    dts = jnp.zeros(most, y0.dtype)
    start = (0, jnp.asarray(0.0), jnp.asarray(0.1), y0, ys, dts)
    i, _, _, y, ys, dts = lax.while_loop(lambda s: (s[1] < 1.0 - 1e-6) & (s[0] < most), body, start)
    return y, (i, ys, dts)


def _adaptive_fwd(params: Any, y0: jax.Array, most: int) -> Any:
    y, saved = _adaptive_forward(params, y0, most)
    return y, (params, saved)


def _adaptive_bwd(most: int, res: Any, ybar: jax.Array) -> Any:
    params, (count, ys, dts) = res

    def body(s: Any) -> Any:
        i, a, pbar = s
        _, vjp = jax.vjp(lambda p, y: _heun(p, y, dts[i])[0], params, ys[i])
        dp, dy = vjp(a)
        return i - 1, dy, jax.tree.map(jnp.add, pbar, dp)

    zero = jax.tree.map(jnp.zeros_like, params)
    _, a, pbar = lax.while_loop(lambda s: s[0] >= 0, body, (count - 1, ybar, zero))
    return pbar, a


odeint_adaptive.defvjp(_adaptive_fwd, _adaptive_bwd)


def neural_ode(adaptive: bool = False, batch: int = 1024, d: int = 64, h: int = 64) -> Program:
    """The gradient of a neural ODE's loss over a batch of trajectories (``vmap`` of the solver,
    parameters shared), through the checkpointed adjoint of :func:`odeint_fixed` or
    :func:`odeint_adaptive`."""

    def loss(params: Any, y0: jax.Array) -> jax.Array:
        if adaptive:
            solve = lambda y: odeint_adaptive(params, y, 24)
        else:
            solve = lambda y: odeint_fixed(params, y, 16)
        return jnp.mean(jnp.sum(jax.vmap(solve)(y0) ** 2, -1))

    y0 = jax.random.normal(jax.random.key(9), (batch, d))
    return jax.value_and_grad(loss), (_params(d, h), y0)


# --- a bounded adaptive solver -------------------------------------------------------------------


def bounded_heun(params: Any, y0: jax.Array, steps: int = 64, tol: float = 1e-3) -> jax.Array:
    """Adaptive Euler-Heun on [0, 1] as a ``scan`` of at most ``steps`` checkpointed steps, the
    steps after the end (or rejected) masked with ``where``: the bounded form of a while loop,
    differentiable in reverse mode."""

    @jax.checkpoint
    def step(s: Any, _: Any) -> Any:
        t, dt, y = s
        dt = jnp.minimum(dt, 1.0 - t)
        new, err = _heun(params, y, dt)
        ok = (err <= tol) & (t < 1.0)
        grow = jnp.clip(0.9 * jnp.sqrt(tol / jnp.maximum(err, 1e-12)), 0.2, 5.0)
        dt = jnp.where(t < 1.0, dt * grow, dt)
        return (jnp.where(ok, t + dt, t), dt, jnp.where(ok, new, y)), None

    start = (jnp.asarray(0.0), jnp.asarray(0.05), y0)
    return lax.scan(step, start, None, length=steps)[0][2]


def bounded_solver(batch: int = 4096, d: int = 32, h: int = 32) -> Program:
    """Per-trajectory gradients (``jax.grad`` under ``jax.vmap``) of a loss through
    :func:`bounded_heun`."""

    def loss(params: Any, y0: jax.Array) -> jax.Array:
        return jnp.sum(bounded_heun(params, y0) ** 2)

    y0 = jax.random.normal(jax.random.key(11), (batch, d))
    return jax.vmap(jax.grad(loss), (None, 0)), (_params(d, h), y0)


def bounded_solver_mean(batch: int = 4096, d: int = 32, h: int = 32) -> Program:
    """The gradient of the batch's mean loss (``jax.grad`` of ``jax.vmap``) through
    :func:`bounded_heun`."""

    def loss(params: Any, y0: jax.Array) -> jax.Array:
        ys = jax.vmap(lambda y: bounded_heun(params, y))(y0)
        return jnp.mean(jnp.sum(ys**2, -1))

    y0 = jax.random.normal(jax.random.key(11), (batch, d))
    return jax.value_and_grad(loss), (_params(d, h), y0)


# --- conjugate gradients -------------------------------------------------------------------------


def kernel_cg(n: int = 3000, d: int = 3) -> Program:
    """A Gaussian-process posterior mean's loss: ``K^{-1} y`` by conjugate gradients
    (``jax.scipy.sparse.linalg.cg``: a ``while_loop`` to a tolerance, differentiated by
    ``custom_linear_solve``, whose backward pass runs CG again), the kernel made outside the
    loop; value and gradient in the inputs and the length scale."""

    def loss(x: jax.Array, y: jax.Array, scale: jax.Array) -> jax.Array:
        k = jnp.exp(-_sqdist(x, x) / scale) + 0.1 * jnp.eye(x.shape[0])
        alpha, _ = jax.scipy.sparse.linalg.cg(lambda v: k @ v, y, tol=1e-5, maxiter=200)
        return jnp.dot(y, alpha)

    k1, k2 = jax.random.split(jax.random.key(13))
    x = jax.random.normal(k1, (n, d))
    y = jnp.sin(x[:, 0]) + 0.1 * jax.random.normal(k2, (n,))
    return jax.value_and_grad(loss, (0, 2)), (x, y, jnp.asarray(2.0))


def hand_cg(n: int = 3000, d: int = 3) -> Program:
    """Conjugate gradients written by hand in a ``while_loop`` (the value only)."""

    def fun(x: jax.Array, y: jax.Array) -> jax.Array:
        k = jnp.exp(-_sqdist(x, x) / 2.0) + 0.1 * jnp.eye(x.shape[0])

        def body(s: Any) -> Any:
            i, v, r, p, rr = s
            kp = k @ p
            a = rr / jnp.dot(p, kp)
            v, r = v + a * p, r - a * kp
            new = jnp.dot(r, r)
            return i + 1, v, r, r + new / rr * p, new

        start = (0, jnp.zeros_like(y), y, y, jnp.dot(y, y))
        s = lax.while_loop(lambda s: (s[0] < 200) & (s[4] > 1e-8), body, start)
        return s[1]

    k1, k2 = jax.random.split(jax.random.key(13))
    x = jax.random.normal(k1, (n, d))
    return fun, (x, jnp.sin(x[:, 0]) + 0.1 * jax.random.normal(k2, (n,)))


PROGRAMS: dict[str, Callable[[], Program]] = {
    "sinkhorn_value": sinkhorn_value,
    "sinkhorn_envelope": sinkhorn_envelope,
    "sinkhorn_implicit": sinkhorn_implicit,
    "ode_fixed": neural_ode,
    "ode_adaptive": lambda: neural_ode(adaptive=True),
    "bounded_per_example": bounded_solver,
    "bounded_mean": bounded_solver_mean,
    "kernel_cg": kernel_cg,
    "hand_cg": hand_cg,
}


# --- the same, through libraries (optional: ``pip install ott-jax diffrax``) ---------------------


def ott_sinkhorn(n: int = 2000, m: int = 2500, d: int = 3, grad: bool = False) -> Program:
    """ott-jax's ``Sinkhorn`` on a ``PointCloud`` (its cost matrix made once, read by every
    iteration), the regularized transport cost; with ``grad``, its gradient in the points
    (ott's implicit differentiation)."""
    from ott.geometry import pointcloud
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn

    def cost(x: jax.Array, y: jax.Array) -> jax.Array:
        geom = pointcloud.PointCloud(x, y, epsilon=0.5)
        out = sinkhorn.Sinkhorn(threshold=1e-3, max_iterations=200)(
            linear_problem.LinearProblem(geom)
        )
        return out.reg_ot_cost

    return (jax.value_and_grad(cost, (0, 1)) if grad else cost), _clouds(n, m, d)


def diffrax_ode(adaptive: bool = False, batch: int = 1024, d: int = 64, h: int = 64) -> Program:
    """The gradient of a neural ODE's loss over a batch of trajectories through diffrax's
    ``diffeqsolve`` (Heun's method; fixed steps or a PID controller), differentiated by its
    ``RecursiveCheckpointAdjoint``, ``vmap`` over the trajectories."""
    import diffrax

    def loss(params: Any, y0: jax.Array) -> jax.Array:
        term = diffrax.ODETerm(lambda t, y, args: _field(args, y))

        def solve(y: jax.Array) -> jax.Array:
            if adaptive:
                control = diffrax.PIDController(rtol=1e-3, atol=1e-3)
                extra = dict(dt0=0.1, stepsize_controller=control, max_steps=64)
            else:
                extra = dict(dt0=1.0 / 16, max_steps=16)
            sol = diffrax.diffeqsolve(
                term,
                diffrax.Heun(),
                0.0,
                1.0,
                y0=y,
                args=params,
                adjoint=diffrax.RecursiveCheckpointAdjoint(),
                **extra,
            )
            return sol.ys[-1]

        return jnp.mean(jnp.sum(jax.vmap(solve)(y0) ** 2, -1))

    y0 = jax.random.normal(jax.random.key(9), (batch, d))
    return jax.value_and_grad(loss), (_params(d, h), y0)


def _rbf(x: jax.Array, scale: jax.Array) -> jax.Array:
    """The Gaussian kernel matrix of the rows of ``x``, made outside the solvers below."""
    return jnp.exp(-0.5 * _sqdist(x, x) / scale**2)


def _points_and_vector(n: int, d: int, batch: int = 0) -> tuple[jax.Array, jax.Array]:
    """``n`` points in ``d`` dimensions and a right-hand side (``batch`` of them, if given)."""
    k1, k2 = jax.random.split(jax.random.key(0))
    return jax.random.normal(k1, (n, d)), jax.random.normal(k2, (batch, n) if batch else (n,))


def optimistix_fixed_point(n: int = 2000, d: int = 3) -> Program:
    """The fixed point of ``z = tanh(K z / n) + b`` by optimistix's ``fixed_point`` (its
    iteration in equinox's while loop), the kernel made outside it; the value only (its
    gradient factors the dense Jacobian by LU, which needs the whole matrix)."""
    import optimistix as optx

    def fun(x: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
        k = _rbf(x, scale) / x.shape[0]
        solver = optx.FixedPointIteration(rtol=1e-5, atol=1e-5)
        step = lambda z, args: jnp.tanh(args[0] @ z) + args[1]
        sol = optx.fixed_point(step, solver, jnp.zeros_like(b), args=(k, b), max_steps=100)
        return jnp.sum(sol.value**2)

    return fun, (*_points_and_vector(n, d), jnp.asarray(1.3))


def lineax_gmres(n: int = 1500, d: int = 3) -> Program:
    """``b^T K^{-1} b`` for a kernel matrix scaled column by column (not symmetric) through
    lineax's ``GMRES``: its gradient solves with the transposed matrix, made outside the loop
    from the same kernel; value and gradient in the points and the length scale."""
    import lineax as lx

    def loss(x: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
        k = _rbf(x, scale) * (1.0 + jnp.arange(n)[None, :] / n)
        operator = lx.MatrixLinearOperator(k + 2.0 * jnp.eye(n))
        solver = lx.GMRES(rtol=1e-3, atol=1e-3, max_steps=500, restart=20)
        return jnp.dot(b, lx.linear_solve(operator, b, solver=solver).value)

    return jax.value_and_grad(loss, (0, 2)), (*_points_and_vector(n, d), jnp.asarray(0.5))


def lineax_cg(n: int = 2000, d: int = 3, batch: int = 0) -> Program:
    """``b^T K^{-1} b`` through lineax's ``linear_solve`` with its ``CG`` solver (an equinox
    primitive whose implementation runs the while loop; lineax differentiates it by solving
    again), the kernel made outside the solve; value and gradient in the points and the length
    scale. With ``batch``, that many right-hand sides solved under ``jax.vmap``."""
    import lineax as lx

    def loss(x: jax.Array, b: jax.Array, scale: jax.Array) -> jax.Array:
        k = _rbf(x, scale) + 2.0 * jnp.eye(x.shape[0])
        operator = lx.MatrixLinearOperator(k, lx.positive_semidefinite_tag)
        solver = lx.CG(rtol=1e-3, atol=1e-3, max_steps=2000)

        def solve(rhs: jax.Array) -> jax.Array:
            return jnp.dot(rhs, lx.linear_solve(operator, rhs, solver=solver).value)

        return jnp.sum(jax.vmap(solve)(b)) if batch else solve(b)

    return jax.value_and_grad(loss, (0, 2)), (*_points_and_vector(n, d, batch), jnp.asarray(0.5))


LIBRARY: dict[str, Callable[[], Program]] = {
    "ott_value": ott_sinkhorn,
    "ott_grad": lambda: ott_sinkhorn(grad=True),
    "diffrax_fixed": diffrax_ode,
    "diffrax_adaptive": lambda: diffrax_ode(adaptive=True),
    "lineax_cg": lineax_cg,
    "lineax_cg_vmap": lambda: lineax_cg(batch=4),
    "lineax_gmres": lineax_gmres,
    "optimistix_fixed_point": optimistix_fixed_point,
}
