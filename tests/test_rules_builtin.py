"""Built-in rules fire on the forms users write, never change results beyond float tolerance,
and never fire where their precondition fails."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memsafe import policy
from memsafe.graph import inline_calls
from memsafe.rewrite.algebraic import rewritten
from memsafe.rewrite.match import apply_rules
from memsafe.rules import builtin_rules
from memsafe.xla import memsafe_jit
from tests.budget import examples

sizes = st.integers(2, 9)


@pytest.fixture(autouse=True)
def _any_depth(monkeypatch):
    """These tests are about matching; the depth at which the GEMM pays off is tested apart."""

    monkeypatch.setattr(policy, "REWRITE", dataclasses.replace(policy.REWRITE, min_gemm_depth=1))


def _rand(shape, seed, dtype=jnp.float32):
    return jax.random.normal(jax.random.PRNGKey(seed), shape, dtype)


def fired(f, *args) -> list[str]:
    """Rules that fire on ``f`` at ``args``, checking the rewritten program equals jax.jit."""
    closed = inline_calls(jax.make_jaxpr(f)(*args))
    new, records = apply_rules(closed, builtin_rules(), measure=False)
    out = jax.core.eval_jaxpr(new.jaxpr, new.consts, *args)
    ref = jax.jit(f)(*args)
    ref = ref if isinstance(ref, tuple | list) else [ref]
    for a, b in zip(out, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)
    return [r.rule for r in records]


def _diff(x, y):
    return x[:, None] - y[None]


SQDIST_FORMS = {
    "pow": lambda x, y: jnp.sum(_diff(x, y) ** 2, -1),
    "square": lambda x, y: jnp.square(x[:, None, :] - y[None, :, :]).sum(axis=2),
    "mul_twice": lambda x, y: ((x[:, None] - y[None]) * (x[:, None] - y[None])).sum(-1),
    "mul_self": lambda x, y: (lambda d: (d * d).sum(-1))(_diff(x, y)),
    "pow_float": lambda x, y: jnp.sum(jnp.power(_diff(x, y), 2.0), -1),
    "reversed": lambda x, y: jnp.sum((y[None, :, :] - x[:, None, :]) ** 2, -1),
    "vmap_vmap": lambda x, y: jax.vmap(
        jax.vmap(lambda a, b: jnp.sum((a - b) ** 2), (None, 0)), (0, None)
    )(x, y),
    "vmap_dot": lambda x, y: jax.vmap(lambda a: jax.vmap(lambda b: jnp.dot(a - b, a - b))(y))(x),
    "transposed_inputs": lambda x, y: jnp.sum((x.T[:, :, None] - y.T[:, None, :]) ** 2, 0),
    "inside_kernel": lambda x, y: jnp.exp(-0.5 * jnp.sum(_diff(x, y) ** 2, -1)),
}


def test_each_sqdist_form_fires():
    x, y = _rand((4, 3), 0), _rand((5, 3), 1)
    for name, f in SQDIST_FORMS.items():
        assert fired(f, x, y) == ["pairwise_sqdist"], name


@settings(max_examples=examples(8))
@given(n=sizes, m=sizes, d=sizes, seed=st.integers(0, 100))
def test_sqdist_forms_agree_over_shapes(n, m, d, seed):
    x, y = _rand((n, d), seed), _rand((m, d), seed + 1)
    forms = list(SQDIST_FORMS.values())
    everything = lambda x, y: [f(x, y) for f in forms]
    assert fired(everything, x, y) == ["pairwise_sqdist"] * len(forms)


def test_sqdist_rewrite_is_a_gemm_clamped_at_zero():
    x = _rand((6, 5), 0)
    closed = inline_calls(rewritten(SQDIST_FORMS["pow"]).jaxpr(x, x))  # the primal of its VJP
    names = [e.primitive.name for e in closed.jaxpr.eqns]
    assert "dot_general" in names and "max" in names and "integer_pow" not in names
    out = rewritten(SQDIST_FORMS["pow"])(x, x)
    assert float(jnp.min(out)) >= 0.0  # the clamp: cancellation never gives negative distances


@pytest.mark.slow  # 38 s of the default suite's 900 s budget; the unbatched forms run by default
@settings(max_examples=6)
@given(b=sizes, n=sizes, m=sizes, d=sizes)
def test_batched_sqdist(b, n, m, d):
    x, y, y2 = _rand((b, n, d), 0), _rand((b, m, d), 1), _rand((m, d), 2)

    def forms(x, y, y2):
        both = jnp.sum((x[:, :, None] - y[:, None]) ** 2, -1)
        one = jnp.sum((x[:, :, None] - y2[None, None]) ** 2, -1)
        vm = jax.vmap(SQDIST_FORMS["vmap_vmap"])(x, y)
        vm_one = jax.vmap(SQDIST_FORMS["vmap_dot"], (0, None))(x, y2)
        return both, one, vm, vm_one

    assert fired(forms, x, y, y2) == ["pairwise_sqdist"] * 4


@settings(max_examples=examples(6))
@given(n=sizes, m=sizes, d=sizes)
def test_l2_distance_and_cosine(n, m, d):
    x, y = _rand((n, d), 3), _rand((m, d), 4)

    def l2(x, y):
        return jnp.sqrt(jnp.sum(_diff(x, y) ** 2, -1)), jnp.linalg.norm(_diff(x, y), axis=-1)

    assert fired(l2, x, y) == ["pairwise_l2dist"] * 2
    # a squared norm is the norm's rule, squared: its gradient is the norm's (see the next test)
    norm_squared = lambda x, y: jnp.linalg.norm(_diff(x, y), axis=-1) ** 2
    assert fired(norm_squared, x, y) == ["pairwise_l2dist"]

    def unit(v):
        return v / jnp.linalg.norm(v, axis=-1, keepdims=True)

    assert fired(lambda x, y: unit(x) @ unit(y).T, x, y) == ["pairwise_cosine"]
    assert fired(lambda x, y: jnp.sum(unit(x)[:, None] * unit(y)[None], -1), x, y) == [
        "pairwise_dot",
        "pairwise_cosine",
    ]


@settings(max_examples=6)
@given(n=sizes, k=sizes, m=sizes)
def test_products_read_in_part(n, k, m):
    a, b, c = _rand((n, k), 5), _rand((k, n), 6), _rand((k, m), 7)

    def forms(a, b, c):
        return (
            jnp.diag(a @ b),
            jnp.diagonal(a @ b),
            jnp.diag(a @ (b.T).T),
            jnp.trace(a @ b),
            jnp.sum(a @ c),
        )

    rules = ["diag_of_product"] * 3 + ["trace_of_product", "sum_of_product"]
    assert sorted(fired(forms, a, b, c)) == sorted(rules)


NOT_DISTANCES = {
    "sum_over_wrong_axis": lambda x, y: jnp.sum(_diff(x, y) ** 2, 0),
    "cube": lambda x, y: jnp.sum(_diff(x, y) ** 3, -1),
    "l1": lambda x, y: jnp.sum(jnp.abs(_diff(x, y)), -1),
    "plus": lambda x, y: jnp.sum((x[:, None] + y[None]) ** 2, -1),
    "broadcast_over_wrong_axis": lambda x, y: jnp.sum((x[:, None, :] - y[None, :, :1]) ** 2, -1),
    "difference_also_used": lambda x, y: (lambda d: jnp.sum(d**2, -1) + d.mean())(_diff(x, y)),
    "squares_also_used": lambda x, y: (lambda s: (jnp.sum(s, -1), s.max()))(_diff(x, y) ** 2),
}


def test_distance_rules_do_not_fire_where_preconditions_fail():
    x, y = _rand((4, 3), 8), _rand((5, 3), 9)
    for name, f in NOT_DISTANCES.items():
        assert fired(f, x, y) == [], name
    xi = jnp.arange(12, dtype=jnp.int32).reshape(4, 3)
    yi = jnp.arange(15, dtype=jnp.int32).reshape(5, 3)
    assert fired(SQDIST_FORMS["pow"], xi, yi) == []  # integers: clamping would change meaning


def test_diag_of_non_square_product_does_not_fire():
    a, b = _rand((4, 3), 10), _rand((3, 6), 11)
    assert fired(lambda a, b: jnp.diag(a @ b), a, b) == []


def test_sqdist_rewrite_removes_the_n_m_d_temporary():
    """Measured with XLA's buffer assignment: the naive form stores n*m*d, the GEMM form not."""
    n, m, d = 1000, 2000, 64
    args = (jax.ShapeDtypeStruct((n, d), jnp.float32), jax.ShapeDtypeStruct((m, d), jnp.float32))
    f = SQDIST_FORMS["pow"]
    naive = memsafe_jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes
    new = memsafe_jit(rewritten(f)).lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert naive >= n * m * d * 4
    assert new < n * m * 4 * 2
    rec = rewritten(f).plan(*args).rules[0]
    assert rec.rule == "pairwise_sqdist" and rec.bytes_saved == naive - new
    assert "test_rules_builtin.py" in rec.where


def test_knn_benchmark_form_is_rewritten_to_a_gemm():
    """benchmarks/knn.py's broadcast form at n=10,000, m=1,000,000, d=64 (traced, not run)."""

    def knn(x, y):
        d2 = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
        return jax.lax.top_k(-d2, 10)

    args = (
        jax.ShapeDtypeStruct((10_000, 64), jnp.float32),
        jax.ShapeDtypeStruct((1_000_000, 64), jnp.float32),
    )
    closed = inline_calls(rewritten(knn).jaxpr(*args))
    names = [e.primitive.name for e in closed.jaxpr.eqns]
    assert "dot_general" in names and "top_k" in names
    big = [e for e in closed.jaxpr.eqns for v in e.outvars if v.aval.ndim == 3]
    assert not big  # no n x m x d value left


def test_memsafe_jit_rewrites_the_naive_distance_before_anything_else():
    """Naively, XLA stores the 200 x 300 x 64 difference (15 MB); rewritten, the program fits
    2 MB with no split, and plan() names the rule and the user's line."""
    import memsafe

    x, y = _rand((200, 64), 0), _rand((300, 64), 1)
    f = SQDIST_FORMS["pow"]
    g = memsafe.jit(f, memory_limit="2MB")
    np.testing.assert_allclose(g(x, y), jax.jit(f)(x, y), rtol=1e-4, atol=1e-3)
    plan = g.plan(x, y)
    assert plan.before.temps >= 200 * 300 * 64 * 4 and plan.after.total <= 2e6
    assert not plan.splits
    (rec,) = plan.rules
    assert rec.rule == "pairwise_sqdist" and "test_rules_builtin.py" in rec.where
    assert rec.bytes_saved > 200 * 300 * 64 * 4 * 0.9


@pytest.mark.parametrize(("d", "fires"), [(3, False), (5, False), (6, True), (64, True)])
def test_distance_rules_fire_only_where_the_gemm_pays_off(monkeypatch, d, fires):
    """Below ``policy.REWRITE.min_gemm_depth`` features the fused broadcast form is faster
    (measured): no rewrite."""

    monkeypatch.setattr(policy, "REWRITE", dataclasses.replace(policy.REWRITE, min_gemm_depth=6))
    x, y = _rand((40, d), 0), _rand((50, d), 1)
    assert (fired(SQDIST_FORMS["pow"], x, y) == ["pairwise_sqdist"]) is fires


@pytest.mark.parametrize("rule", builtin_rules(), ids=lambda r: r.name)
def test_builtin_patterns_do_not_match_their_replacement(rule):
    """The check built-in rules skip at run time (check_replacement=False), run on each form."""
    assert not rule.check_replacement
    for variant in rule.variants:
        variant.check_not_self_matching()


def test_batched_variants_need_at_least_their_forms_operations():
    """Rule.variants_for traces a form's batched variants only where the program holds the
    form's operations: exact only because each batched variant needs those operations too."""
    from memsafe.rules.pattern import required_ops

    for rule in builtin_rules():
        variants = rule.variants
        forms = [v for v in variants if " batched " not in v.label]
        assert len(forms) == len(rule.patterns)
        for v in variants:
            form = forms[int(v.label.split()[1])]
            assert required_ops(form) <= required_ops(v), (rule.name, v.label)
        every = set().union(*(required_ops(v) for v in variants))
        assert rule.variants_for(every) == variants  # all of them, in the same order
        for form in forms:
            assert form not in rule.variants_for(required_ops(form) - {form.root.node.op})


def test_batched_variants_end_one_axis_above_their_form():
    """Rule.variants_for traces a form's batched variants only where the program has values of
    one more axis than the form's result: exact only because each batched variant's result has
    that rank (jax.vmap adds one axis) and a variant matches only values of its result's rank."""
    from memsafe.rules.pattern import required_ops

    for rule in builtin_rules():
        variants = rule.variants
        forms = [v for v in variants if " batched " not in v.label]
        for v in variants:
            form = forms[int(v.label.split()[1])]
            extra = 0 if v is form else 1
            assert v.root.rank == form.root.rank + extra, (rule.name, v.label)
        every = set().union(*map(required_ops, variants))
        ranks = {v.root.rank for v in variants}
        assert rule.variants_for(every, ranks) == variants
        for form in forms:
            without = ranks - {form.root.rank + 1}
            kept = rule.variants_for(every, without)
            mine = [v for v in kept if v.label.split(" batched")[0] == form.label]
            assert mine == [form], (rule.name, form.label)


def test_batched_variants_end_at_their_forms_operation():
    """Rule.variants_for, given the (operation, rank) pairs of the program's values, traces a
    form's batched variants only where a value of the form's root operation has one more axis:
    exact only because each batched variant's root is that operation (``jax.vmap`` keeps it)
    and a variant matches only values of its root's operation and rank."""
    from memsafe.rules.pattern import required_ops

    for rule in builtin_rules():
        variants = rule.variants
        forms = [v for v in variants if " batched " not in v.label]
        for v in variants:
            form = forms[int(v.label.split()[1])]
            assert v.root.node.op == form.root.node.op, (rule.name, v.label)
        every = set().union(*map(required_ops, variants))
        ends = {(v.root.node.op, v.root.rank) for v in variants}
        assert rule.variants_for(every, None, ends) == variants
        for form in forms:
            without = ends - {(form.root.node.op, form.root.rank + 1)}
            kept = rule.variants_for(every, None, without)
            mine = [v for v in kept if v.label.split(" batched")[0] == form.label]
            assert mine == [form], (rule.name, form.label)


def test_declared_needs_hold_in_every_variant():
    """Each built-in rule declares the (operation, operand's operation) pairs it needs
    (Rule.needs), and every variant, batched or not, holds them and its form's pairs: a program
    without one of them is not traced for the rule (Rule.variants_for), which is exact only so."""
    from memsafe.rules.pattern import required_edges

    for rule in builtin_rules():
        assert rule.needs, rule.name
        variants = rule.variants
        forms = [v for v in variants if " batched " not in v.label]
        for v in variants:
            assert rule.needs <= required_edges(v), (rule.name, v.label)
            form = forms[int(v.label.split()[1])]
            assert required_edges(form) <= required_edges(v), (rule.name, v.label)


def _fresh(rule):
    """A copy of a built-in rule, nothing traced yet."""
    from memsafe.rules.pattern import Rule

    return Rule(
        rule.name,
        rule.patterns,
        rule.replacement,
        shapes=[tuple(s) for s in rule.specs],
        dtypes=rule.dtypes,
        needs=rule.needs,
        check_replacement=False,
    )


def test_rule_without_its_needs_is_not_traced():
    """A program without a pair the rule needs traces none of its forms; one with every pair of
    a form traces it (and keeps it), and a form whose own pairs are missing is left out."""
    from memsafe.rules.distance import SQDIST
    from memsafe.rules.pattern import required_edges, required_ops

    every_ops = set().union(*map(required_ops, SQDIST.variants))
    every_edges = set().union(*map(required_edges, SQDIST.variants))
    missing = _fresh(SQDIST)
    assert missing.variants_for(every_ops, edges=every_edges - {("square", "sub")}) == []
    assert missing._forms == {}  # nothing traced
    rule = _fresh(SQDIST)
    assert [v.label for v in rule.variants_for(every_ops, edges=every_edges)] == [
        v.label for v in SQDIST.variants
    ]
    # forms 2 and 3 (the norm squared) hold sqrt -> reduce_sum; 0 and 1 do not
    plain = _fresh(SQDIST)
    kept = plain.variants_for(every_ops, edges=set(SQDIST.needs))
    assert {v.label.split(" batched")[0] for v in kept} == {"form 0", "form 1"}


def test_rules_skipped_by_needs_leave_matches_alone():
    """The pre-filter only skips what could not match: the squared distance still fires, and a
    program without its pairs (an MLP-like sum of squares of a difference of same-shaped
    arrays has them, a plain product does not) traces no rule."""
    import jax
    import jax.numpy as jnp

    from memsafe.rewrite.match import find_matches
    from memsafe.rules.distance import SQDIST

    x = jax.ShapeDtypeStruct((64, 32), jnp.float32)
    y = jax.ShapeDtypeStruct((48, 32), jnp.float32)
    closed = jax.make_jaxpr(lambda x, y: jnp.sum((x[:, None] - y[None]) ** 2, -1))(x, y)
    found = find_matches(closed, [SQDIST], measure=False)
    assert [m.rule.name for m, _ in found] == ["pairwise_sqdist"]
    rule = _fresh(SQDIST)
    closed = jax.make_jaxpr(lambda x, y: x @ y.T)(x, y)
    assert find_matches(closed, [rule], measure=False) == []
    assert rule._forms == {}


def test_sum_of_product_keeps_what_the_products_sum_to_for_nan_and_inf():
    """sum(A @ B) factored as sum(A, 0) . sum(B, 1) gave -inf where the products summed to NaN
    (fuzz seed 7313: a -inf in A against a column of B of both signs); every non-finite kind
    now comes out as the n x k x m products sum to (float64 reference)."""
    from memsafe.rules.linalg import sum_of_product

    rng = np.random.default_rng(0)
    kinds = [np.nan, np.inf, -np.inf, 0.0, 1.5, -2.0]
    run = jax.jit(sum_of_product)
    for _ in range(400):
        a = rng.normal(size=(5, 3)).astype(np.float32)
        b = rng.normal(size=(3, 4)).astype(np.float32)
        for _ in range(rng.integers(1, 4)):
            (a if rng.random() < 0.5 else b).flat[rng.integers(0, 12)] = kinds[rng.integers(6)]
        with np.errstate(invalid="ignore"):
            want = np.sum(a.astype(np.float64)[:, :, None] * b.astype(np.float64)[None])
        got = float(run(a, b))
        if np.isfinite(want):
            assert np.isclose(got, want, rtol=1e-4, atol=1e-4), (a, b, got, want)
        else:
            assert got == want or (np.isnan(got) and np.isnan(want)), (a, b, got, want)


def test_sum_of_product_gradient_is_the_products_sums_for_nan_and_inf():
    """The non-finite fix-up's selects had a zero derivative wherever the sum was NaN or
    infinite, so a gradient through the rewrite was zero where jax.jit's is finite (fuzz seed
    10014: a NaN in B zeroed the whole gradient of A's partner). The gradient is now that of
    sum(A @ B) for every kind of value, NaN and infinities where jax.jit has them."""
    from memsafe.rules.linalg import sum_of_product

    rng = np.random.default_rng(1)
    kinds = [np.nan, np.inf, -np.inf, 0.0, 1.5, -2.0]
    got_fn = jax.jit(jax.grad(sum_of_product, argnums=(0, 1)))
    want_fn = jax.jit(jax.grad(lambda a, b: jnp.sum(a @ b), argnums=(0, 1)))
    for _ in range(200):
        a = rng.normal(size=(5, 3)).astype(np.float32)
        b = rng.normal(size=(3, 4)).astype(np.float32)
        for _ in range(rng.integers(0, 4)):
            (a if rng.random() < 0.5 else b).flat[rng.integers(0, 12)] = kinds[rng.integers(6)]
        for got, want in zip(got_fn(a, b), want_fn(a, b)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("rule", builtin_rules(), ids=lambda r: r.name)
def test_replacements_have_their_patterns_gradient_for_nan_and_inf(rule):
    """memsafe's backward program differentiates the rewritten forward, so each replacement's
    gradient must be its pattern's, NaN and infinities where jax.jit has them: each form of each
    built-in rule against jax.jit's gradient of that form, under random cotangents, half the
    draws with NaN, infinities or zeros put in (sizes distinct per dimension; the semantics do
    not depend on them). Found wrong: diag and trace of a product (a NaN in B made jax.jit's dA
    NaN over a column, the replacement's at one entry), sum of a product (zero where the sum was
    NaN: fuzz seed 10014) and the squared norm (NaN over both rows in jax.jit, one coordinate in
    the sum of squares' gradient)."""
    rng = np.random.default_rng(sum(map(ord, rule.name)))
    kinds = [np.nan, np.inf, -np.inf, 0.0]
    sizes = dict(zip("nkmd", (4, 3, 5, 2)))
    shapes = [[d if isinstance(d, int) else sizes[d] for d in spec] for spec in rule.specs]
    argnums = tuple(range(1, len(shapes) + 1))  # the arguments after the cotangent

    def grad_of(fn):
        return jax.jit(jax.grad(lambda ct, *a: jnp.sum(fn(*a) * ct), argnums))

    for form in rule.patterns:
        out_shape = jax.eval_shape(form, *[jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes])
        want_fn, got_fn = grad_of(form), grad_of(rule.replacement)
        for draw in range(40):
            args = [rng.normal(size=s).astype(np.float32) for s in shapes]
            for _ in range(int(rng.integers(1, 3)) if draw % 2 else 0):
                a = args[rng.integers(len(args))]
                a.flat[rng.integers(a.size)] = kinds[rng.integers(len(kinds))]
            ct = rng.normal(size=out_shape.shape).astype(np.float32)
            for g, w in zip(got_fn(ct, *args), want_fn(ct, *args)):
                np.testing.assert_allclose(g, w, rtol=2e-3, atol=2e-3, equal_nan=True)
