"""The rule API: user rules as pattern/replacement pairs, symbolic shapes, axis roles, filters,
blocking, registration, clear errors, and what plan() reports."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe import policy
from memsafe.graph import inline_calls
from memsafe.rewrite.algebraic import rewritten
from memsafe.rewrite.match import apply_rules
from memsafe.rules import Rule, register_rule, registered_rules, unregister_rule


@pytest.fixture(autouse=True)
def _any_depth(monkeypatch):
    """These tests are about matching; the depth at which the GEMM pays off is tested apart."""

    monkeypatch.setattr(policy, "REWRITE", dataclasses.replace(policy.REWRITE, min_gemm_depth=1))


def _rand(shape, seed=0):
    return jax.random.normal(jax.random.PRNGKey(seed), shape)


def apply(rules, f, *args):
    """(rules fired, rewritten outputs, jax.jit outputs)."""
    closed = inline_calls(jax.make_jaxpr(f)(*args))
    new, records = apply_rules(closed, rules, measure=False)
    out = jax.core.eval_jaxpr(new.jaxpr, new.consts, *args)
    ref = jax.tree_util.tree_leaves(jax.jit(f)(*args))
    for a, b in zip(out, ref):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    return [r.rule for r in records]


SORT_MIN = Rule(
    "sort_then_first_is_min",
    lambda x: jnp.sort(x, axis=1)[:, 0],
    lambda x: jnp.min(x, axis=1),
    shapes="n m",
)


def test_user_rule_matches_at_any_size_and_keeps_results():
    for shape in [(3, 4), (17, 2), (5, 40)]:
        assert apply([SORT_MIN], lambda x: jnp.sort(x, axis=1)[:, 0] + 1, _rand(shape)) == [
            "sort_then_first_is_min"
        ]
    # sorting along the other axis, or reading another element, is not the pattern
    assert apply([SORT_MIN], lambda x: jnp.sort(x, axis=0)[:, 0], _rand((4, 4))) == []
    assert apply([SORT_MIN], lambda x: jnp.sort(x, axis=1)[:, 1], _rand((4, 4))) == []


def test_axis_roles_not_axis_order():
    """The pattern reduces its input's axis 1; a program reducing a transposed value matches,
    and the replacement gets the input back in the pattern's axis order."""
    rule = Rule("max_as_neg_min", lambda x: jnp.max(x, axis=1), lambda x: -jnp.min(-x, axis=1),
                shapes="n m")  # fmt: skip
    z = _rand((3, 5))
    assert apply([rule], lambda z: jnp.max(z, axis=0), z) == ["max_as_neg_min"]
    assert apply([rule], lambda z: jnp.max(z.T, axis=1), z) == ["max_as_neg_min"]
    assert apply([rule], lambda z: jnp.max(z[None], axis=2), z) == []  # a unit axis: other rank


def test_size_dependent_literals_are_symbolic():
    """mean divides by the reduced size: traced at two sizes, memsafe learns the literal is 1/m
    (or m) and checks it against the program's size."""
    rule = Rule("mean", lambda x: jnp.mean(x, axis=1),
                lambda x: jnp.sum(x, 1) * (1.0 / x.shape[1]), shapes="n m")  # fmt: skip
    assert apply([rule], lambda x: jnp.mean(x, axis=1), _rand((4, 6))) == ["mean"]
    assert apply([rule], lambda x: jnp.mean(x, axis=1), _rand((9, 2))) == ["mean"]
    # dividing by a number that is not the size is not a mean
    assert apply([rule], lambda x: jnp.sum(x, axis=1) / 3.0, _rand((4, 6))) == []
    assert apply([rule], lambda x: jnp.sum(x, axis=1) / 6.0, _rand((4, 6))) == ["mean"]


def test_tied_dimensions_must_agree():
    """``d`` names one size for both inputs: a program where they differ does not match."""
    rule = Rule(
        "outer_of_sums",
        lambda a, b: jnp.sum(a, 1)[:, None] * jnp.sum(b, 1)[None, :],
        lambda a, b: jnp.sum(a, 1)[:, None] @ jnp.sum(b, 1)[None, :],
        shapes="n d, m d",
    )
    f = lambda a, b: jnp.sum(a, 1)[:, None] * jnp.sum(b, 1)[None, :]
    assert apply([rule], f, _rand((4, 3)), _rand((5, 3))) == ["outer_of_sums"]
    assert apply([rule], f, _rand((4, 3)), _rand((5, 6))) == []


def test_example_args_tie_equal_sizes():
    rule = Rule(
        "pairwise_dot_example",
        lambda x, y: jnp.sum(x[:, None] * y[None], -1),
        lambda x, y: x @ y.T,
        example_args=(jnp.ones((3, 5)), jnp.ones((7, 5))),
    )
    f = rule.patterns[0]
    assert apply([rule], f, _rand((6, 2)), _rand((4, 2))) == ["pairwise_dot_example"]


def test_filters_and_dtype_categories():
    big_d = Rule(
        "only_wide",
        lambda x: jnp.sum(jnp.exp(x), axis=1),
        lambda x: jnp.exp(x) @ jnp.ones(x.shape[1]),
        shapes="n d",
        filters=[lambda m: m.sizes["d"] >= 4],
    )
    f = lambda x: jnp.sum(jnp.exp(x), axis=1)
    assert apply([big_d], f, _rand((2, 5))) == ["only_wide"]
    assert apply([big_d], f, _rand((2, 3))) == []
    ints = Rule("factor", lambda x: x * x + x, lambda x: x * (x + 1), shapes="n", dtype=jnp.int32)
    assert apply([ints], lambda x: x * x + x, jnp.arange(5)) == ["factor"]
    assert apply([ints], lambda x: x * x + x, jnp.arange(5.0)) == []  # float: another category
    any_num = Rule("factor_any", lambda x: x * x + x, lambda x: x * (x + 1), shapes="n",
                   dtypes=(jnp.integer, jnp.floating))  # fmt: skip
    assert apply([any_num], lambda x: x**2 + x, jnp.arange(5.0)) == ["factor_any"]


def test_intermediate_used_outside_blocks_the_rewrite():
    rule = Rule("softplus", lambda x: jnp.log(1 + jnp.exp(x)), jax.nn.softplus, shapes="n")
    assert apply([rule], lambda x: jnp.log(1 + jnp.exp(x)), _rand((5,))) == ["softplus"]
    shared = lambda x: (lambda e: (jnp.log(1 + e), e))(jnp.exp(x))
    assert apply([rule], shared, _rand((5,))) == []
    # the same expression computed again elsewhere is not an outside use
    assert apply([rule], lambda x: (jnp.log(1 + jnp.exp(x)), jnp.exp(x)), _rand((5,))) == [
        "softplus"
    ]
    twice = lambda x: jnp.log(jnp.exp(x) + 1) + jnp.log(1 + jnp.exp(2 * x))
    assert apply([rule], twice, _rand((5,))) == ["softplus", "softplus"]


def test_batched_variants_of_a_user_rule():
    rule = Rule("softplus", lambda x: jnp.log(1 + jnp.exp(x)), jax.nn.softplus, shapes="n")
    assert apply([rule], lambda x: jnp.log(1 + jnp.exp(x)), _rand((3, 5))) == ["softplus"]
    unbatched = Rule("softplus1", lambda x: jnp.log(1 + jnp.exp(x)), jax.nn.softplus, shapes="n",
                     batched=False)  # fmt: skip
    assert apply([unbatched], lambda x: jnp.log(1 + jnp.exp(x)), _rand((3, 5))) == []


def test_bad_rules_are_named():
    with pytest.raises(ValueError, match="exactly one of shapes"):
        Rule("r", lambda x: x, lambda x: x)
    with pytest.raises(ValueError, match="neither a dimension name nor a size"):
        Rule("r", lambda x: x, lambda x: x, shapes="n-1")
    with pytest.raises(TypeError, match="replacement must be a function"):
        Rule("r", lambda x: x, 3, shapes="n")
    with pytest.raises(ValueError, match="name"):
        Rule("", lambda x: x, lambda x: x, shapes="n")
    with pytest.raises(ValueError, match="computes nothing"):
        Rule("r", lambda x: x, lambda x: x, shapes="n").variants
    with pytest.raises(ValueError, match="one array"):
        Rule("r", lambda x: (x + 1, x), lambda x: x, shapes="n").variants
    with pytest.raises(ValueError, match="could not trace"):
        Rule("r", lambda x: x @ x, lambda x: x, shapes="n m").variants
    with pytest.raises(ValueError, match="its own replacement"):
        Rule("r", lambda x: jnp.exp(x), lambda x: jnp.exp(x), shapes="n").variants
    looping = Rule("r", lambda x: jnp.sum(jnp.exp(x)), lambda x: jnp.exp(jax.nn.logsumexp(x)),
                   shapes="n")  # fmt: skip
    with pytest.raises(ValueError, match="its own replacement"):
        looping.variants
    with pytest.raises(TypeError, match=r"memsafe\.Rule"):
        register_rule(lambda x: x)


def test_registered_rule_runs_in_memsafe_jit_and_plan_reports_it():
    """sort(x)[:, 0] stores a sorted copy of x; with the rule the program fits a limit the
    original does not, and plan() names the rule, the user's line and the measured saving."""
    register_rule(SORT_MIN)
    try:
        assert SORT_MIN in registered_rules()

        def first_of_sorted(x):
            return jnp.sort(x, axis=1)[:, 0]

        x = _rand((1000, 1000))
        g = memsafe.jit(first_of_sorted, memory_limit="6MB")
        np.testing.assert_allclose(g(x), jnp.min(x, axis=1))
        plan = g.plan(x)
        assert not plan.fits_unchanged and plan.before.total > 6e6 >= plan.after.total
        (rec,) = [r for r in plan.rules if r.rule == "sort_then_first_is_min"]
        assert "test_rules.py" in rec.where
        assert rec.bytes_saved > 0.9 * 1000 * 1000 * 4  # ~ the sorted copy, measured by XLA
        assert rec.flops_saved > 0
        assert "sort_then_first_is_min" in str(plan)
    finally:
        assert unregister_rule("sort_then_first_is_min")
    assert SORT_MIN not in registered_rules()


def test_rewrite_gives_a_traceable_function():
    f = lambda x, y: jnp.sum((x[:, None] - y[None]) ** 2, -1)
    g = rewritten(f)
    x, y = _rand((4, 3)), _rand((6, 3), 1)
    np.testing.assert_allclose(g(x, y), f(x, y), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(jax.jit(g)(x, y), f(x, y), rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda x: g(x, y).sum())(x)
    np.testing.assert_allclose(grad, jax.grad(lambda x: f(x, y).sum())(x), rtol=1e-4, atol=1e-4)
    assert [r.rule for r in g.plan(x, y).rules] == ["pairwise_sqdist"]
