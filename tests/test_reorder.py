"""Matrix-chain reordering: same results as jax.jit, the order the math says, and the savings
measured by XLA (memory_analysis, cost_analysis)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import memsafe
from memsafe.graph import evaluate, inline_calls
from memsafe.rewrite.algebraic import rewritten
from memsafe.rewrite.chains import best_order, reorder_chains
from memsafe.xla import memsafe_jit
from tests.agree import assert_like_jit
from tests.budget import examples

dims = st.integers(1, 12)


def _rand(shape, seed):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def reordered(f, *args):
    """(records, rewritten outputs) checked against jax.jit."""
    closed = inline_calls(jax.make_jaxpr(f)(*args))
    new, records = reorder_chains(closed)
    out = jax.core.eval_jaxpr(new.jaxpr, new.consts, *args)
    ref = jax.tree_util.tree_leaves(jax.jit(f)(*args))
    for a, b in zip(out, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    return records


def test_matrix_vector_chain_goes_right_to_left():
    a, b, v = _rand((30, 20), 0), _rand((20, 40), 1), _rand((40,), 2)
    (rec,) = reordered(lambda a, b, v: a @ b @ v, a, b, v)
    assert rec.rule == "reorder_chain" and rec.detail.endswith("(30x20 @ (20x40 @ 40x1))")
    assert rec.flops_saved == (2 * 30 * 20 * 40 + 2 * 30 * 40) - (2 * 20 * 40 + 2 * 30 * 20)
    assert rec.bytes_saved == 30 * 40 * 4 - 20 * 4
    (rec,) = reordered(lambda a, b, v: (b.T @ a.T).T @ v, a, b, v)  # transposes looked through
    assert rec.detail.endswith("(30x20 @ (20x40 @ 40x1))")


def test_already_best_order_and_shared_products_are_left_alone():
    a, b, w = _rand((30, 20), 0), _rand((20, 40), 1), _rand((30,), 3)
    assert reordered(lambda w, a, b: w @ a @ b, w, a, b) == []
    shared = lambda a, b, v: (lambda m: (m @ v, m.sum()))(a @ b)
    assert reordered(shared, a, b, _rand((40,), 2)) == []


def test_sums_are_products_with_ones():
    a, b = _rand((30, 20), 0), _rand((20, 40), 1)
    for f in [
        lambda a, b: jnp.sum(a @ b),
        lambda a, b: jnp.sum(a @ b, axis=0),
        lambda a, b: jnp.sum(a @ b, axis=1),
    ]:
        (rec,) = reordered(f, a, b)
        assert "ones" in rec.detail and rec.bytes_saved > 0


@settings(max_examples=examples(10))
@given(
    shape=st.lists(dims, min_size=4, max_size=6),
    vec_left=st.booleans(),
    vec_right=st.booleans(),
    transpose=st.integers(0, 5),
)
def test_random_chains_agree_with_jit(shape, vec_left, vec_right, transpose):
    """Any chain, with vectors at the ends and a transposed factor, gives jax.jit's result; the
    chosen order, where one is chosen, has a lower peak."""
    mats = [_rand((shape[i], shape[i + 1]), i) for i in range(len(shape) - 1)]
    if vec_left:
        mats[0] = mats[0][0]
    if vec_right:
        mats[-1] = mats[-1][:, 0]
    t = transpose % len(mats)

    def chain(*ms):
        out = None
        for i, m in enumerate(ms):
            m = m.T if (i == t and m.ndim == 2) else m  # the program stores this factor transposed
            out = m if out is None else out @ m
        return out

    args = [m.T if (i == t and m.ndim == 2) else m for i, m in enumerate(mats)]
    for rec in reordered(chain, *args):
        assert rec.bytes_saved > 0


def test_best_order_minimizes_peak_then_flops():
    tree, cost = best_order([10, 1000, 10, 1000], 4)  # (10x1000)(1000x10)(10x1000)
    assert tree == ((0, 1), 2) and cost.peak == 10 * 10 * 4
    tree, _ = best_order([4096, 4096, 4096, 1], 4)
    assert tree == (0, (1, 2))


def _compiled(f, *avals):
    compiled = memsafe_jit(f).lower(*avals).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost
    return compiled.memory_analysis().temp_size_in_bytes, cost["flops"]


def _as_program(branch):
    """Temps and flops of a cond branch compiled as a program of its own."""
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in branch.jaxpr.invars]
    return _compiled(lambda *a: evaluate(branch, a), *avals)


def _branches(f, *avals):
    """The (as written, reordered) branches of the one guarded chain in ``rewritten(f)``."""
    closed = inline_calls(jax.make_jaxpr(rewritten(f))(*avals))
    (cond,) = [e for e in closed.jaxpr.eqns if e.primitive.name == "cond"]
    return cond.params["branches"]


def test_abv_at_4096_temps_and_flops_fall_by_the_factor_the_math_says():
    """(A @ B) @ v stores the n x n product and costs 2n^3 + 2n^2 flops; A @ (B @ v) stores
    n-vectors (two, as a branch of its own) and costs 4n^2: ratios n / 2 and (n + 1) / 2, read
    from XLA (compiled, not run). The reordered chain is the branch that runs on finite
    factors; the other runs the chain as written (the split pass chunks it under a limit)."""
    n = 4096
    mat = jax.ShapeDtypeStruct((n, n), jnp.float32)
    vec = jax.ShapeDtypeStruct((n,), jnp.float32)
    f = lambda a, b, v: a @ b @ v
    temps_before, flops_before = _compiled(f, mat, mat, vec)
    written, reordered = _branches(f, mat, mat, vec)
    temps_after, flops_after = _as_program(reordered)
    assert temps_before == n * n * 4 and temps_after <= 2 * n * 4  # B @ v, and the result
    assert flops_before == 2 * n**3 + 2 * n**2 and flops_after == 4 * n**2
    assert temps_before / temps_after >= n / 2
    assert flops_before / flops_after == (n + 1) / 2
    assert _as_program(written)[1] == flops_before


def test_memsafe_jit_reorders_and_chunks_the_chain_as_written():
    """Under a limit that the n x n product breaks, the reordered chain runs; the chain as
    written (for non-finite factors) is chunked to fit beside it."""
    n = 1024
    a, b, v = _rand((n, n), 0), _rand((n, n), 1), _rand((n,), 2)
    f = lambda a, b, v: a @ b @ v
    limit = 2 * n * n * 4 + 64 * 1024
    g = memsafe.jit(f, memory_limit=limit)
    np.testing.assert_allclose(g(a, b, v), jax.jit(f)(a, b, v), rtol=1e-3, atol=1e-2)
    plan = g.plan(a, b, v)
    assert not plan.fits_unchanged and plan.after.total <= limit
    assert [r.rule for r in plan.rules] == ["reorder_chain"]
    assert plan.after.temps < plan.before.temps / 4


def test_a_chain_with_an_inf_keeps_jax_jits_nans():
    """Fuzz seed 1937: an inf in ``x`` makes ``(x @ y.T) @ v`` NaN where the products' signs
    mix, and inf in ``x @ (y.T @ v)``. The reordered chain runs only where every factor is
    finite; here the chain runs as written, in chunks, under the limit."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, 6)).astype(np.float32)
    y = rng.standard_normal((700, 6)).astype(np.float32)
    v = rng.standard_normal((700, 5)).astype(np.float32)
    x[3, 2] = np.inf

    def f(x, y, v):
        return (x @ y.T) @ v

    g = memsafe.jit(f, memory_limit=100_000)
    want = memsafe_jit(f)(x, y, v)
    got = g(x, y, v)
    assert np.isnan(want).sum() == 5
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    plan = g.plan(x, y, v)
    assert plan.rules and plan.splits and plan.after.total <= 100_000
    x[3, 2] = 1.0  # finite: the reordered chain runs, and agrees
    np.testing.assert_allclose(g(x, y, v), memsafe_jit(f)(x, y, v), rtol=1e-4, atol=1e-4)


def test_a_chain_whose_result_dominates_is_left_for_the_split():
    """Self-attention's scores ``(x @ wq) @ (x @ wk).T``: the best order ``x @ ((wq @ wk.T) @
    x.T)`` saves two n x d products beside the n x n result, too little to pay for the cond it
    runs behind, which kept the scores from being split (refused under 30% of jax.jit's
    footprint). Left as written, they split along the queries."""
    n, d = 1024, 64
    x, wq, wk, wv = _rand((n, d), 0), *(_rand((d, d), i) / 8 for i in (1, 2, 3))

    def attention(x, wq, wk, wv):
        return jax.nn.softmax((x @ wq) @ (x @ wk).T / 8.0, -1) @ (x @ wv)

    assert reordered(attention, x, wq, wk, wv) == []
    need = memsafe_jit(attention).lower(x, wq, wk, wv).compile().memory_analysis()
    limit = int(0.3 * (need.temp_size_in_bytes + need.argument_size_in_bytes))
    f = memsafe.jit(attention, memory_limit=limit)
    assert f.plan(x, wq, wk, wv).splits
    assert_like_jit(f(x, wq, wk, wv), attention, x, wq, wk, wv)
