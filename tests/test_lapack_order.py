"""Batched LAPACK calls run one after another where jaxlib 0.10's CPU kernels would otherwise
wait for each other forever (memsafe.lapack_order)."""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.scipy.linalg import solve_triangular

import memsafe
from memsafe._jax import lapack_waits_on_its_pool
from memsafe.graph import evaluate
from memsafe.lapack_order import calls_lapack, order


def three_solves(a, b, c):
    return (
        solve_triangular(a, b, lower=True),
        solve_triangular(a, c, lower=False),
        solve_triangular(a, b + c, lower=True, trans=1),
    )


def _data(batch=50, n=4, seed=0):
    rng = np.random.default_rng(seed)
    a = np.tril(rng.standard_normal((batch, n, n))) + 3 * np.eye(n)
    return a, rng.standard_normal((batch, n, n)), rng.standard_normal((batch, n, n))


def _lapack_eqns(jaxpr, inside_cond=False):
    """(primitive name, whether under a cond) of every LAPACK equation, in program order."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "triangular_solve":
            found.append(inside_cond)
        for value in eqn.params.values():
            inner = value[:1] if isinstance(value, tuple) else (value,)  # a cond's first branch
            for v in inner:
                if isinstance(v, jax.extend.core.ClosedJaxpr):
                    found += _lapack_eqns(v.jaxpr, inside_cond or eqn.primitive.name == "cond")
    return found


def test_each_solve_after_the_first_waits_under_a_cond():
    args = _data()
    closed = jax.make_jaxpr(three_solves)(*args)
    assert calls_lapack(closed.jaxpr)
    assert _lapack_eqns(closed.jaxpr) == [False, False, False]
    ordered = order(closed)
    assert _lapack_eqns(ordered.jaxpr) == [False, True, True]


def test_values_are_unchanged_nan_and_inf_included():
    a, b, c = _data()
    a[3, 0, 0] = np.nan  # the first solve's first matrix: the predicate reads NaN
    b[0, 0, 0] = np.inf
    closed = jax.make_jaxpr(three_solves)(a, b, c)
    got = jax.jit(lambda *xs: evaluate(order(closed), xs))(a, b, c)
    want = jax.jit(three_solves)(a, b, c)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_solves_inside_a_loop_body_are_ordered_there():
    def looped(a, b, c):
        def body(i, acc):
            x, y, z = three_solves(a, b * i, c)
            return acc + x + y + z

        return lax.fori_loop(0, 3, body, jnp.zeros_like(b))

    args = _data()
    closed = jax.make_jaxpr(looped)(*args)
    ordered = order(closed)
    assert _lapack_eqns(ordered.jaxpr) == [False, True, True]
    got = jax.jit(lambda *xs: evaluate(ordered, xs))(*args)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(jax.jit(looped)(*args)), rtol=0)


def test_a_program_without_lapack_is_left_alone():
    closed = jax.make_jaxpr(lambda x: jnp.sin(x) @ x)(np.ones((3, 3)))
    assert not calls_lapack(closed.jaxpr)


@pytest.mark.skipif(not lapack_waits_on_its_pool(), reason="only jaxlib 0.10's CPU kernels wait")
def test_independent_batched_solves_finish():
    """jax.jit of the same program hangs within seconds on two cores with jaxlib 0.10.2; memsafe's
    program, original one included (it fits), runs 200 times."""
    script = textwrap.dedent(
        """
        import jax, numpy as np, memsafe
        from tests.test_lapack_order import _data, three_solves
        jax.config.update("jax_enable_x64", True)
        a, b, c = (jax.numpy.asarray(x) for x in _data(batch=20_000, n=6))
        f = memsafe.jit(three_solves, memory_limit="1GiB")
        for _ in range(200):
            jax.block_until_ready(f(a, b, c))
        print("finished")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240
    )
    assert "finished" in done.stdout, done.stderr[-2000:]


def test_memsafe_answers_equal_jax_jit():
    args = _data(batch=400, n=5, seed=1)
    want = jax.jit(three_solves)(*args)
    got = memsafe.jit(three_solves, memory_limit="1GiB")(*args)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
