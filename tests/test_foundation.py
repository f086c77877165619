"""The driver's contract where no rewrite is needed: limits parse, fitting programs run unchanged,
impossible limits raise, pytrees and static arguments work, gradients go through."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe.graph import Graph, estimate, inline_calls
from memsafe.limits import format_bytes, parse_limit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("2GB", 2 * 10**9),
        ("1.5GiB", int(1.5 * 2**30)),
        (1024, 1024),
        ("100", 100),
        ("3 kib", 3072),
    ],
)
def test_parse_limit(text, expected):
    assert parse_limit(text) == expected


@pytest.mark.parametrize("bad", ["", "abc", "12 parsecs", "-5MiB", 0, -3, True, None, "1e-9B"])
def test_parse_limit_rejects(bad):
    with pytest.raises(ValueError, match="memory_limit"):
        parse_limit(bad)


def test_format_bytes():
    assert format_bytes(160_000_000) == "152.6 MiB"
    assert format_bytes(512) == "512 B"


def test_fitting_program_is_unchanged_and_equal():
    def f(x, y):
        return {"s": jnp.sum(jnp.exp(x @ y.T), axis=1), "t": (x * 2, y.mean())}

    x = jnp.arange(12.0).reshape(4, 3) / 10
    y = jnp.ones((5, 3))
    g = memsafe.jit(f, memory_limit="1MiB")
    out, ref = g(x, y), jax.jit(f)(x, y)
    jax.tree_util.tree_map(np.testing.assert_allclose, out, ref)
    plan = g.plan(x, y)
    assert plan.fits_unchanged and plan.after.total <= 2**20
    assert plan.before.total == plan.after.total


def test_static_args_and_kwargs():
    def f(x, n, *, scale):
        return x * n * scale

    g = memsafe.jit(f, memory_limit=10**6, static_argnums=1, static_argnames="scale")
    x = jnp.ones(3)
    np.testing.assert_allclose(g(x, 3, scale=2.0), x * 6)
    np.testing.assert_allclose(g(x, 4, scale=2.0), x * 8)


def test_inputs_plus_outputs_over_limit_raises_with_sizes():
    x = jnp.ones((1000, 100))
    with pytest.raises(memsafe.MemoryLimitError, match="arguments and outputs alone") as info:
        memsafe.jit(lambda x: x * 2, memory_limit="100KiB")(x)
    assert info.value.limit == 100 * 1024


def test_gradient_of_fitting_program_matches():
    def f(x):
        return jnp.sum(jnp.sin(x) ** 2)

    g = memsafe.jit(f, memory_limit="1MiB")
    x = jnp.linspace(0, 1, 7)
    np.testing.assert_allclose(jax.grad(g)(x), jax.grad(f)(x), rtol=1e-6)
    np.testing.assert_allclose(jax.jit(jax.grad(g))(x), jax.grad(f)(x), rtol=1e-6)


def test_lower_matches_plan_footprint():
    g = memsafe.jit(lambda x: jnp.cumsum(x) * 2, memory_limit="1MiB")
    x = jnp.ones(1000)
    stats = g.lower(x).compile().memory_analysis()
    assert stats.argument_size_in_bytes == 4000
    assert g.plan(x).after.arguments == 4000


def test_graph_inlines_nested_calls_and_estimates():
    @jax.jit
    def inner(a):
        return jnp.exp(a) @ a.T

    def f(a):
        return jax.nn.relu(inner(a)).sum(0)

    closed = jax.make_jaxpr(f)(jnp.ones((50, 8)))
    flat = inline_calls(closed)
    names = [e.primitive.name for e in flat.jaxpr.eqns]
    assert "jit" not in names and "custom_jvp_call" not in names and "dot_general" in names
    g = Graph(flat)
    est = estimate(g)
    # the 50x50 dot output is materialized: it feeds a reduction after an elementwise op
    assert est.peak_bytes >= 50 * 50 * 4
    assert [g.info(v).bytes for v in g.inputs] == [50 * 8 * 4]


def _with_broken_pass(monkeypatch) -> None:
    """Put a pass that always raises in front of the pipeline."""
    import memsafe.passes as passes

    def run(closed, ctx):
        raise RuntimeError("boom")

    broken = types.SimpleNamespace(__name__="memsafe.passes.broken", run=run)
    monkeypatch.setattr(passes, "PIPELINE", (broken, *passes.PIPELINE))


def _broken_case():
    def f(x, y):
        return jnp.sum(jnp.exp(x @ y.T), axis=1)

    return f, jnp.ones((100, 8)) / 10, jnp.ones((2000, 8)) / 10


def test_a_failing_pass_is_skipped_with_a_warning(monkeypatch):
    """An optimization pass that breaks on unfamiliar code must not break the user's program."""
    _with_broken_pass(monkeypatch)
    monkeypatch.delenv("MEMSAFE_STRICT", raising=False)
    f, x, y = _broken_case()
    g = memsafe.jit(f, memory_limit=300_000)
    with pytest.warns(RuntimeWarning, match="pass 'broken' failed on f"):
        out = g(x, y)
    np.testing.assert_allclose(out, f(x, y), rtol=1e-5)
    plan = g.plan(x, y)
    assert plan.after.total <= 300_000
    assert any(r.pass_name == "broken" for r in plan.passes)


def test_a_failing_pass_is_an_error_when_strict(monkeypatch):
    """Under MEMSAFE_STRICT=1 (the tests) the pass's own exception comes out, with a note."""
    _with_broken_pass(monkeypatch)
    monkeypatch.setenv("MEMSAFE_STRICT", "1")
    f, x, y = _broken_case()
    with pytest.raises(RuntimeError, match="boom") as info:
        memsafe.jit(f, memory_limit=300_000)(x, y)
    assert "memsafe: in pass 'broken' on f (MEMSAFE_STRICT=1)" in info.value.__notes__


def test_pipeline_is_the_pass_modules_in_order():
    from memsafe import passes
    from memsafe.passes import (
        constants,
        distribute,
        fission,
        fold,
        hoist,
        inplace,
        match_replace,
        recompute,
        remat,
        reorder,
        roll,
        schedule,
        split,
        tie,
        trips,
        unflatten,
    )

    assert (
        fold,
        match_replace,
        reorder,
        unflatten,
        inplace,
        hoist,
        distribute,
        roll,
        remat,
        fission,
        trips,
        split,
        schedule,
        recompute,
        constants,
        tie,
    ) == passes.PIPELINE
    names = [name for name, _ in passes.named_passes()]
    assert names == [
        "fold", "match_replace", "reorder", "unflatten", "inplace", "hoist", "distribute", "roll",
        "remat", "fission", "trips", "split",
        "schedule", "recompute", "constants", "tie",
    ]  # fmt: skip


def test_a_user_error_while_tracing_keeps_its_type():
    """A user's ValueError comes back as that ValueError, with memsafe's context as a note."""

    def f(x):
        if x.shape[0] != 3:
            raise ValueError("needs three rows")
        return x * 2

    with pytest.raises(ValueError, match="needs three rows") as info:
        memsafe.jit(f, memory_limit="1MiB")(jnp.ones((4, 2)))
    assert "memsafe: while tracing f at arguments (float32[4, 2])" in info.value.__notes__


def test_a_jax_error_while_tracing_keeps_its_type():
    def f(x, y):
        return x @ y

    with pytest.raises(TypeError, match="dot_general") as info:
        memsafe.jit(f, memory_limit="1MiB")(jnp.ones((3, 4)), jnp.ones((5, 6)))
    assert any("while tracing f at arguments" in n for n in info.value.__notes__)
