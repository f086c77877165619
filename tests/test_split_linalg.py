"""Splitting through linear algebra: triangular solves pass the axis of their independent
columns (left side) or rows (right side) and their batch axes, Cholesky its batch axes. Each
program runs under a quarter of plain jit's footprint and equals jax.jit in float64, forward and
differentiated (the transpose of a triangular solve is a triangular solve with ``transpose_a``
flipped; its cotangent for the matrix contracts the split axis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.scipy.linalg import solve_triangular

import memsafe
from memsafe.graph import Graph, inline_calls
from memsafe.split.prims.gather import Into
from memsafe.split.registry import PLAIN, Mapping, NoRule, RuleContext, axis_map, running_along
from memsafe.split.sinks import Sink
from memsafe.xla import Footprint, memsafe_jit

N, M, D = 3000, 24, 3


def _kernel(a, b):
    return jnp.exp(-0.5 * jnp.sum((a[:, None] - b[None]) ** 2, -1))


def _chol(z):
    return jnp.linalg.cholesky(_kernel(z, z) + 1e-3 * jnp.eye(z.shape[0], dtype=z.dtype))


def left_lower(z, x, y):
    a = solve_triangular(_chol(z), _kernel(z, x), lower=True)
    return a @ a.T, a @ y


def left_lower_transposed(z, x, y):
    a = solve_triangular(_chol(z), _kernel(z, x), lower=True, trans="T")
    return jnp.sum(a**2, 0) @ y[:, 0], jnp.max(a, 1)


def left_upper(z, x, y):
    a = solve_triangular(_chol(z).T, _kernel(z, x) * y[:, 0], lower=False)
    return jnp.sum(jnp.tanh(a), 1)


def right_lower(z, x, y):
    """x L^-1 on the rows of Kfu (the solve's right side): each row is its own system."""
    a = lax.linalg.triangular_solve(_chol(z), _kernel(x, z), left_side=False, lower=True)
    return a.T @ a, jnp.sum(a * y, 0)


def right_upper_transposed(z, x, y):
    a = lax.linalg.triangular_solve(
        _chol(z).T, _kernel(x, z), left_side=False, lower=False, transpose_a=True
    )
    return jnp.sum(a**2)


PROGRAMS = {
    "left_lower": left_lower,
    "left_lower_transposed": left_lower_transposed,
    "left_upper": left_upper,
    "right_lower": right_lower,
    "right_upper_transposed": right_upper_transposed,
}


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (N, D))
    z = x[rng.choice(N, M, replace=False)] + 0.01 * rng.standard_normal((M, D))
    y = rng.standard_normal((N, 1))
    return jnp.asarray(z), jnp.asarray(x), jnp.asarray(y)


def _limit(fun, args, factor=4):
    compiled = memsafe_jit(fun).lower(*args).compile()
    return Footprint.from_compiled(compiled).total // factor


def _close(got, want, rtol=1e-10):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    scale = max(float(np.max(np.abs(want))), 1e-300)
    err = float(np.max(np.abs(got - want))) / scale
    assert err <= rtol, f"relative error {err:.3e}"


def _check(fun, args, factor=4):
    limit = _limit(fun, args, factor)
    safe = memsafe.jit(fun, memory_limit=limit)
    out = safe(*args)
    plan = safe.plan(*args)
    assert plan.splits, plan
    assert any("triangular_solve" in s.ops for s in plan.splits), plan
    assert plan.after.total <= limit, plan
    jax.tree_util.tree_map(_close, out, jax.jit(fun)(*args))
    return plan


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_triangular_solve_forward(name):
    with jax.enable_x64(True):
        _check(PROGRAMS[name], _data())


@pytest.mark.parametrize("name", ["left_lower", "right_upper_transposed"])
def test_triangular_solve_value_and_grad(name):
    """The differentiated program (built by JAX, then split): solves with transpose_a flipped, and
    dot_generals contracting the split axis for the cotangent of the triangular matrix."""

    def loss(z, x, y):
        out = PROGRAMS[name](z, x, y)
        return sum(jnp.mean(o**2) for o in jax.tree_util.tree_leaves(out))

    with jax.enable_x64(True):
        _check(jax.value_and_grad(loss, argnums=(0, 1)), _data(1))


def test_gradient_through_memsafe_backward_program():
    """jax.grad of a memsafe function: the VJP program runs through the same pipeline."""

    def loss(z, x, y):
        a, b = left_lower(z, x, y)
        return jnp.sum(a) + jnp.sum(b**2)

    with jax.enable_x64(True):
        args = _data(2)
        limit = _limit(jax.grad(loss, argnums=(0, 1)), args)
        safe = memsafe.jit(loss, memory_limit=limit)
        got = jax.jit(jax.grad(safe, argnums=(0, 1)))(*args)
        want = jax.jit(jax.grad(loss, argnums=(0, 1)))(*args)
        backward = safe.backward_plan(*args)
        assert backward.splits and backward.after.total <= limit, backward
    jax.tree_util.tree_map(_close, got, want)


def batched_solve(x):
    """A batch of small SPD systems: Cholesky and triangular solves along the batch axis."""
    s = jnp.sin(3 * x)
    cov = x[:, :, None] * x[:, None, :] + s[:, :, None] * s[:, None, :]
    chol = jnp.linalg.cholesky(cov + 0.5 * jnp.eye(x.shape[1], dtype=x.dtype))
    sol = solve_triangular(chol, jnp.cos(x)[..., None], lower=True)
    logdet = 2 * jnp.sum(jnp.log(jnp.diagonal(chol, axis1=1, axis2=2)), 1)
    return jnp.sum(sol**2) + jnp.sum(logdet)


def test_cholesky_and_solve_along_batch_axis():
    x = np.random.default_rng(3).standard_normal((20_000, 6))
    with jax.enable_x64(True):
        for fun in (batched_solve, jax.grad(batched_solve)):
            plan = _check(fun, (jnp.asarray(x),))
            assert any("cholesky" in s.ops for s in plan.splits), plan


def _eqn(fun, *shapes, prim):
    with jax.enable_x64(True):
        closed = inline_calls(jax.make_jaxpr(fun)(*[jnp.zeros(s) for s in shapes]))
    eqns = [e for e in Graph(closed).eqns if e.primitive.name == prim]
    assert len(eqns) == 1
    return eqns[0]


@pytest.mark.parametrize("left", [True, False])
def test_triangular_solve_mappings(left):
    def fun(a, b):
        return lax.linalg.triangular_solve(a, b, left_side=left, lower=True)

    eqn = _eqn(fun, (2, 5, 5), (2, 5, 7) if left else (2, 7, 5), prim="triangular_solve")
    free, system = (2, 1) if left else (1, 2)
    assert axis_map(eqn, ("in", 1), free, PLAIN) == Mapping(ins=(None, free), outs=(free,))
    assert axis_map(eqn, ("out", 0), free, PLAIN) == Mapping(ins=(None, free), outs=(free,))
    assert axis_map(eqn, ("in", 0), 0, PLAIN) == Mapping(ins=(0, 0), outs=(0,))
    for side, axis in [(("in", 1), system), (("out", 0), system), (("in", 0), 1), (("in", 0), 2)]:
        with pytest.raises(NoRule, match="triangular system"):
            axis_map(eqn, side, axis, PLAIN)


def test_cholesky_mappings():
    eqn = _eqn(jnp.linalg.cholesky, (3, 4, 4), prim="cholesky")
    assert axis_map(eqn, ("in", 0), 0, PLAIN) == Mapping(ins=(0,), outs=(0,))
    for axis in (1, 2):
        with pytest.raises(NoRule, match="factorizes"):
            axis_map(eqn, ("out", 0), axis, PLAIN)


def test_scatter_window_axis_mapping():
    """The VJP of a batched diagonal (a gather with a full offset axis) scatters along that axis."""

    def fun(c):
        return jax.grad(lambda c: jnp.sum(jnp.diagonal(c, axis1=1, axis2=2)))(c)

    eqn = _eqn(fun, (7, 4, 4), prim="scatter-add")
    assert axis_map(eqn, ("in", 0), 0, PLAIN) == Mapping(ins=(0, None, 0), outs=(0,))
    assert axis_map(eqn, ("out", 0), 0, PLAIN) == Mapping(ins=(0, None, 0), outs=(0,))
    # an indexed axis: each chunk takes the updates whose position it holds (indices whole)
    assert axis_map(eqn, ("out", 0), 1, PLAIN) == Mapping(ins=(1, None, None), outs=(1,))
    # chunks of the index vectors (and their updates) land anywhere: each chunk scatters into
    # the running result, carried from chunk to chunk; a scatter-add sink where nothing can be
    # carried (in loop bodies, on extended chunks)
    into = axis_map(eqn, ("in", 1), 0, PLAIN)
    assert into == Into(ins=(None, 0, 1), outs=(None,))
    sink = running_along(eqn, into).sink(eqn, into)
    assert isinstance(sink, Sink) and sink.kind == "scatter-add" and sink.ins == into.ins
    extended = axis_map(eqn, ("in", 1), 0, RuleContext(extended=True))
    assert isinstance(extended, Sink) and extended.kind == "scatter-add"
    with pytest.raises(NoRule):
        axis_map(eqn, ("in", 1), 1, PLAIN)  # the index vectors themselves


# -- platform-dependent code (jnp.diagonal, lax.platform_dependent) -------------------------


def _platform_scores(x, y, v):
    """A large score matrix through lax.platform_dependent, then a product: the ``cond`` JAX
    emits for it would stop the split; resolved for this backend, it is plain code."""
    s = x @ y.T
    k = lax.platform_dependent(s, cpu=lambda s: jnp.exp(s - 1.0), default=lambda s: jnp.exp(s))
    return k @ v + jnp.sum(jnp.log(jnp.diag(y[:3] @ y[:3].T)))


def test_platform_dependent_code_is_resolved_when_inlining():
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((2000, 4)) * 0.3, rng.standard_normal((1500, 4)) * 0.3
    v = rng.standard_normal((1500, 2))
    with jax.enable_x64(True):
        args = tuple(jnp.asarray(a) for a in (x, y, v))
        flat = inline_calls(jax.make_jaxpr(_platform_scores)(*args))
        names = {e.primitive.name for e in Graph(flat).eqns}
        assert not names & {"cond", "platform_index"}, names
        np.testing.assert_allclose(
            jax.jit(lambda *a: jax.core.eval_jaxpr(flat.jaxpr, flat.consts, *a))(*args)[0],
            jax.jit(_platform_scores)(*args),
            rtol=1e-12,
        )
        limit = _limit(_platform_scores, args)
        safe = memsafe.jit(_platform_scores, memory_limit=limit)
        _close(safe(*args), jax.jit(_platform_scores)(*args))
        plan = safe.plan(*args)
        assert plan.splits and plan.after.total <= limit, plan


def test_a_rule_form_traced_in_one_precision_matches_programs_in_the_other(monkeypatch):
    """A rule's form is traced at its second sizes on first use, perhaps in another test under
    ``jax.enable_x64``: the second trace is made in the precision of the first (the suite's
    order once traced ``diag_of_product`` in float32 and again under x64, and refused its
    "structure changing with its sizes")."""
    from memsafe.rules.linalg import DIAG

    monkeypatch.setattr(DIAG, "_forms", {})
    monkeypatch.setattr(DIAG, "_variants", None)
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((2000, 4)) * 0.3, rng.standard_normal((1500, 4)) * 0.3
    v = rng.standard_normal((1500, 2))
    args = tuple(jnp.asarray(a, jnp.float32) for a in (x, y, v))
    memsafe.jit(_platform_scores, memory_limit=_limit(_platform_scores, args))(*args)
    test_platform_dependent_code_is_resolved_when_inlining()
