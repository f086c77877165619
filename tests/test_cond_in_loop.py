"""A ``lax.cond``/``lax.switch`` inside a loop body whose branches reduce a large loop invariant
(issue 41): a Sinkhorn solver that tests its marginal error only every few iterations, and
switches of three branches that reduce the invariant differently (a sum, a max, an argmax, one
that reads nothing of it), in ``while`` and ``scan`` bodies. The invariant is made inside the
branches that read it, each branch split as a program of its own (its reductions chunk by chunk,
the index whole); answers are jax.jit's (NaN, infinities and ties included) under a limit of the
arguments, the outputs and a quarter of jax.jit's temporaries."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe.split.registry import PLAIN, NoRule, axis_map
from tests.limits import limit_between, plan_fitting

_fits = plan_fitting


def _made_in_cond(plan: memsafe.Plan) -> bool:
    """Whether the plan recomputed an invariant inside a cond's branches."""
    return any("inside the cond body" in str(p) for p in plan.passes)


def _solve_every(c: jax.Array, k: int = 3, eps: float = 0.5) -> Any:
    """Log-domain Sinkhorn potentials for uniform marginals, the row marginal's error computed
    every ``k`` iterations by a ``lax.cond`` in the ``while_loop`` body: (iterations, f, g, the
    last error)."""
    n, m = c.shape
    la, lb = jnp.full(n, -jnp.log(n)), jnp.full(m, -jnp.log(m))

    def error(f: jax.Array, g: jax.Array) -> jax.Array:
        rows = jnp.exp(jax.nn.logsumexp((f[:, None] + g[None] - c) / eps + lb[None], 1))
        return jnp.sum(jnp.abs(rows - jnp.exp(la)))

    def sweep(s: Any) -> Any:
        it, f, g, err = s
        f = -eps * jax.nn.logsumexp((g[None] - c) / eps + lb[None], 1)
        g = -eps * jax.nn.logsumexp((f[:, None] - c) / eps + la[:, None], 0)
        err = lax.cond(it % k == k - 1, lambda: error(f, g), lambda: err)
        return it + 1, f, g, err

    start = (0, jnp.zeros(n), jnp.zeros(m), jnp.asarray(jnp.inf, c.dtype))
    return lax.while_loop(lambda s: (s[0] < 60) & (s[3] > 1e-4), sweep, start)


def _sqdist(x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.sum((x[:, None] - y[None]) ** 2, -1)


def _transport(f: jax.Array, g: jax.Array, c: jax.Array, eps: float = 0.5) -> jax.Array:
    """The transport cost of the plan the potentials make (uniform marginals)."""
    n, m = c.shape
    p = jnp.exp((f[:, None] + g[None] - c) / eps) / (n * m)
    return jnp.sum(p * c)


def _clouds(n: int, m: int) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(41))
    return jax.random.normal(kx, (n, 3)), jax.random.normal(ky, (m, 3)) * 0.8 + 0.3


def _sinkhorn_every(n: int, m: int) -> tuple[Any, tuple]:
    """The transport cost, the iterations run and the last error between two point clouds (the
    cost matrix made once, outside the loop)."""

    def fun(x: jax.Array, y: jax.Array) -> Any:
        c = _sqdist(x, y)
        it, f, g, err = _solve_every(c)
        return _transport(f, g, c), it, err

    return fun, _clouds(n, m)


def test_sinkhorn_with_an_every_k_convergence_test_fits():
    """The cond's branch reduces the cost matrix along both axes (a log-sum-exp over rows, a sum
    over columns); before, every axis of the matrix was refused at the cond."""
    fun, args = _sinkhorn_every(1024, 1280)
    plan = _fits(fun, args)
    assert _made_in_cond(plan), plan


def test_the_envelope_gradient_of_sinkhorn_with_an_every_k_test_fits():
    """Value and gradient w.r.t. both clouds by the envelope theorem, as Sinkhorn's users take
    it (the potentials held fixed): the loop with its cond runs in the forward program, the
    plan and the cost matrix's reads again in the gradient."""

    def cost(x: jax.Array, y: jax.Array) -> jax.Array:
        c = _sqdist(x, y)
        _, f, g, _ = lax.stop_gradient(_solve_every(lax.stop_gradient(c)))
        return _transport(f, g, c)

    plan = _fits(jax.value_and_grad(cost, (0, 1)), _clouds(1024, 1280))
    assert _made_in_cond(plan), plan


def _switch_loop(loop: str, argmax: bool = False, remat: bool = False) -> Any:
    """A loop over (u, v, acc) around the invariant ``c = x y^T`` (made outside it): the body
    updates u and v by reductions of ``c``'s finite entries along each axis, then ``lax.switch``
    on the iteration picks a branch that sums ``exp`` of ``c`` over its rows, takes its column
    max (or, with ``argmax``, the first row of each column's max), or reads nothing of ``c``.
    With ``remat`` the step is a ``jax.checkpoint``: its gradient recomputes each step from the
    carries."""

    def fun(x: jax.Array, y: jax.Array) -> Any:
        c = x[:, None] * y[None]

        def branches(u: jax.Array, v: jax.Array, acc: jax.Array) -> list[Any]:
            summed = lambda: jnp.sum(jnp.exp(jnp.tanh(c + u[:, None])), 0) / c.shape[0]
            if argmax:
                best = lambda: jnp.argmax(c, 0).astype(acc.dtype) / c.shape[0]
            else:
                best = lambda: jnp.max(c + u[:, None], 0)
            return [summed, best, lambda: 0.5 * acc + v]

        def step(i: jax.Array, s: Any) -> Any:
            u, v, acc = s
            finite = jnp.where(jnp.isfinite(c), c, 0.0)
            u = 0.5 * u + jnp.mean(jnp.tanh(finite + v[None]), 1)
            v = 0.5 * v + jnp.mean(jnp.tanh(finite + u[:, None]), 0)
            return u, v, acc + lax.switch(i % 3, branches(u, v, acc))

        step = jax.checkpoint(step) if remat else step
        n, m = c.shape
        start = (jnp.zeros(n), jnp.zeros(m), jnp.zeros(m))
        if loop == "scan":
            return lax.fori_loop(0, 7, step, start)
        body = lambda s: (s[0] + 1, *step(s[0], s[1:]))
        return lax.while_loop(lambda s: s[0] < 7, body, (0, *start))

    return fun


def _points(n: int, m: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    kx, ky = jax.random.split(jax.random.key(seed))
    return jax.random.normal(kx, (n,)), jax.random.normal(ky, (m,))


@pytest.mark.parametrize("loop", ["while", "scan"])
def test_a_switch_of_three_branches_reducing_differently_fits(loop):
    """A sum over the split axis, a max over it and a branch that does not reduce, in a
    ``while`` body and in a ``scan`` body (a ``fori_loop`` with static bounds)."""
    fun = _switch_loop(loop)
    plan = _fits(fun, _points(1024, 1536))
    assert _made_in_cond(plan), plan


def test_nan_and_infinities_in_the_invariant_keep_jax_jits_answers():
    """``c[5, 3]`` is NaN (0 * inf), column 3 and row 700 are infinite: the chunked sums and
    maxima of the branches put NaN and infinities in the accumulated columns where jax.jit does
    (the body's own updates read the finite entries only)."""
    x, y = _points(1024, 1536, 1)
    x = x.at[5].set(0.0).at[700].set(jnp.inf)
    y = y.at[3].set(jnp.inf).at[9].set(-jnp.inf)
    fun = _switch_loop("while")
    acc = np.asarray(jax.jit(fun)(x, y)[-1])  # NaN, infinities and finite values
    assert np.isnan(acc).any() and np.isinf(acc).any() and np.isfinite(acc).any()
    _fits(fun, (x, y))


def test_ties_for_the_max_keep_the_first_row():
    """Integer-valued points give ``c`` many equal entries per column: the chunked argmax keeps
    the first row of each column's max, as jax.jit does, and the max itself is exact."""
    x, y = _points(1024, 1536, 2)
    x, y = jnp.round(x * 2), jnp.round(y * 2)
    for argmax in (False, True):
        fun = _switch_loop("scan", argmax)
        plan = _fits(fun, (x, y))
        assert _made_in_cond(plan), plan


def test_the_gradient_through_a_checkpointed_scan_with_the_switch_fits_half():
    """``jax.grad`` through the scan of ``jax.checkpoint``-ed steps: the backward scan runs each
    step's switch again (its residuals made by one branch, broadcast by another) and the
    transposed switch (a branch summing the cotangent over the split axis, one making it zero),
    both split along the columns with the rest of the step. Under a quarter of jax.jit's
    temporaries it is refused: the column max of the second branch's residual is no sum, so the
    rows cannot split, and the columns leave no room beside the step's whole values."""
    fun = _switch_loop("scan", remat=True)

    def loss(x: jax.Array, y: jax.Array) -> jax.Array:
        u, v, acc = fun(x, y)
        return jnp.sum(u**2) + jnp.sum(v * acc)

    plan = _fits(jax.grad(loss, (0, 1)), _points(1024, 1536, 3), fraction=0.5)
    assert any("cond" in s.ops for s in plan.splits), plan


def _made_or_summed(kind: str) -> Any:
    """A switch at the top level over a large value: its branches exponentiate it, make a
    result by broadcasting, and ignore an operand (``made``), or sum it over its rows, make
    that sum zero, and sum its square (``summed``)."""

    def fun(a: jax.Array, b: jax.Array, i: jax.Array) -> Any:
        big = jnp.tanh(a[:, None] * b[None])
        if kind == "made":
            out = lax.switch(
                i,
                [
                    lambda z, w: jnp.exp(z) + w[None],
                    lambda z, w: jnp.zeros_like(z),
                    lambda z, w: jnp.full(z.shape, 2.0) * w[None],
                ],
                big,
                b,
            )
            return jnp.sum(out, 0)
        s, t = lax.switch(
            i,
            [
                lambda z: (jnp.sum(z, 0), jnp.exp(z)),
                lambda z: (jnp.zeros(z.shape[1]), z * 2),
                lambda z: (jnp.sum(z * z, 0), -z),
            ],
            big,
        )
        return s, jnp.sum(t, 1)

    return fun


@pytest.mark.parametrize("kind", ["made", "summed"])
@pytest.mark.parametrize("index", [0, 1, 2])
def test_a_switch_whose_branches_make_or_sum_a_result_splits(kind, index):
    """Branches that carry the split axis differently are reached again from all of them: one
    that makes a result at chunk shape, one that does not read an operand; a result some
    branches sum over the axis into (and another makes zero) adds up over the chunks."""
    a = jax.random.normal(jax.random.key(0), (2048,))
    b = jax.random.normal(jax.random.key(1), (1024,))
    plan = _fits(_made_or_summed(kind), (a, b, jnp.asarray(index)))
    assert any("cond" in s.ops for s in plan.splits), plan


def test_a_branch_that_sums_where_another_reads_the_value_whole_is_refused():
    """One branch sums over the split axis into a result the other computes from a value read
    whole: the chunks' results would not add up to the cond's."""

    def fun(a: jax.Array, b: jax.Array, i: jax.Array) -> Any:
        big = jnp.tanh(a[:, None] * b[None])
        s = lax.switch(i, [lambda z, w: jnp.sum(z, 0), lambda z, w: w * 2.0], big, b)
        return s, jnp.exp(big)

    a = jax.random.normal(jax.random.key(0), (2048,))
    b = jax.random.normal(jax.random.key(1), (1024,))
    m = jax.make_jaxpr(fun)(a, b, 0).jaxpr.eqns
    (cond,) = [e for e in m if e.primitive.name == "cond"]
    with pytest.raises(NoRule, match="another gives it a value that is no such sum"):
        axis_map(cond, ("in", 1), 0, PLAIN)


def test_the_solver_samples_every_sinkhorn_refused_before_splits():
    """Deep fuzz seed 10 of the ``solver`` family (the campaign 2026-11-28-solver-sample refused
    it, with 6 more ``every`` Sinkhorns: "cond: the body sums over the split axis into a
    result"): the gradient of a transport cost inside ``jax.grad``, its loop's error computed
    every few iterations by a cond, splits with jax.jit's answers under the limit."""
    from tests.fuzz.forced import run_seed

    result = run_seed(10, ("solver",))
    assert "every" in result.case.flags, result.describe()
    assert result.interesting and result.outcome == "split", result.describe()


def _reset_or_step(loop: str, coupled: bool = False) -> Any:
    """``jax.vmap`` over trajectories of a loop whose body mixes a buffer with the state, then
    conds between a step of the state and a reset of it to a value read whole (a broadcast the
    branch makes; under ``vmap`` it is broadcast along the trajectories in that branch only):
    the cond reached from the buffer alone leaves the state whole, which the loop chunks. With
    ``coupled``, no ``vmap``: the reset broadcasts the mean of the buffer over the trajectories,
    a value no chunk can make."""

    def step(b: jax.Array, y: jax.Array, w: jax.Array) -> Any:
        return b, jnp.tanh(y @ w)

    def reset(b: jax.Array, y: jax.Array, w: jax.Array) -> Any:
        made = jnp.mean(b, 0) if coupled else w[0]
        return b * 0.5, jnp.broadcast_to(made, y.shape)

    def run(w: jax.Array, y: jax.Array, b: jax.Array) -> Any:
        def body(i: Any, s: Any) -> Any:
            y, b = s
            b = 0.9 * b + 0.1 * y
            b, y = lax.cond(i % 3 == 0, reset, step, b, y, w)
            return y, b

        if loop == "while":
            grown = lambda s: (s[0] + 1, *body(s[0], s[1:]))
            return lax.while_loop(lambda s: s[0] < 7, grown, (0, y, b))[1:]
        return lax.fori_loop(0, 7, body, (y, b))

    def fun(w: jax.Array, ys: jax.Array, bufs: jax.Array) -> Any:
        y, b = run(w, ys, bufs) if coupled else jax.vmap(run, (None, 0, 0))(w, ys, bufs)
        return jnp.sum(y, 0), jnp.sum(b, 0)

    return fun


def _trajectories(shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    w = jax.random.normal(jax.random.key(0), (128, 128)) / 11
    ys = jax.random.normal(jax.random.key(1), shape)
    return w, ys, jax.random.normal(jax.random.key(2), shape)


@pytest.mark.parametrize("loop", ["while", "scan"])
def test_a_cond_that_resets_a_batched_state_to_a_broadcast_splits(loop):
    """Before: refused ("cond: its branches carry the split axis to different operands or
    results (the loop's result 1 does not carry the split axis, ...)": the cond was reached
    from the buffer alone, its first chunked operand). The cond is reached again from every
    operand the loop chunks (the buffer and the state), and the reset makes the state at chunk
    shape: each chunk's results are that chunk of the cond's, whichever branch runs."""
    plan = _fits(_reset_or_step(loop), _trajectories((2048, 8, 128)))
    assert any(loop in s.ops for s in plan.splits), plan


def test_a_reset_to_a_value_coupling_the_trajectories_is_refused_naming_the_cond_result():
    """The reset broadcasts the buffer's mean over the trajectories: a sum over the split axis
    the step branch does not make, so neither a chunk nor a sum of chunks is the cond's."""
    fun, args = _reset_or_step("scan", coupled=True), _trajectories((16384, 128))
    limit = limit_between(fun, args, 0.25)
    with pytest.raises(
        memsafe.MemoryLimitError,
        match=r"axis 0: cond: .*branch 1 cannot give result 1 \(float32\[16384,128\]\) the "
        r"split axis",
    ):
        memsafe.jit(fun, memory_limit=limit).plan(*args)
