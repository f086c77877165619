"""jax.jit parity of memsafe functions: static arguments by position or keyword, AOT stages on
pytrees, eval_shape, donation by name, compiler options, repr, forward mode's message; each
checked against jax.jit and, where it is an error, with the message the user gets."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe.xla import CPU_COMPILER_OPTIONS, compiler_options, merged_options
from tests.agree import assert_like_jit


def knn(x, y, k):
    """Squared distances to the k nearest points of y."""
    d = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    neg, idx = jax.lax.top_k(-d, k)
    return -neg, idx


X = jnp.asarray(np.random.default_rng(0).normal(size=(40, 8)), jnp.float32)
Y = jnp.asarray(np.random.default_rng(1).normal(size=(300, 8)), jnp.float32)


def _close(a, b):
    jax.tree_util.tree_map(lambda u, v: np.testing.assert_allclose(u, v, rtol=1e-5), a, b)


@pytest.mark.parametrize("declared", [{"static_argnums": 2}, {"static_argnames": "k"}])
@pytest.mark.parametrize("passed", ["position", "keyword"])
def test_static_argument_by_position_or_keyword(declared, passed):
    f = memsafe.jit(knn, memory_limit="4MiB", **declared)
    ref = jax.jit(knn, **declared)
    got = f(X, Y, 5) if passed == "position" else f(X, Y, k=5)
    want = ref(X, Y, 5) if passed == "position" else ref(X, Y, k=5)
    _close(got, want)
    assert f.static_argnums == (2,) and f.static_argnames == ("k",)


def test_static_argument_that_needs_splitting_by_keyword():
    """The issue's case: k by keyword while only static_argnums was given, under a limit that
    needs the distance matrix split."""
    x = jnp.ones((200, 16))
    y = jnp.asarray(np.random.default_rng(2).normal(size=(20_000, 16)), jnp.float32)
    f = memsafe.jit(knn, memory_limit="8MiB", static_argnums=2)
    _close(f(x, y, k=3), knn(x, y, 3))
    assert f.plan(x, y, k=3).splits


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"static_argnames": "kk"}, ValueError, "static_argnames ['kk'] are not parameters of knn"),
        ({"static_argnums": 3}, ValueError, "static_argnums [3] out of range for knn"),
        ({"static_argnums": "k"}, TypeError, "static_argnums must be ints, got 'k'"),
        ({"static_argnums": 2, "donate_argnames": "k"}, ValueError, "both static and donated"),
    ],
)
def test_bad_argnums_and_argnames_are_named(options, error, message):
    with pytest.raises(error) as info:
        memsafe.jit(knn, memory_limit="4MiB", **options)
    assert message in str(info.value)


def test_unhashable_static_argument():
    f = memsafe.jit(lambda x, n: x * len(n), memory_limit="1MiB", static_argnums=1)
    with pytest.raises(TypeError, match="static arguments must be hashable"):
        f(jnp.ones(3), [1, 2])


def loss(params, batch):
    x, y = batch
    pred = jnp.tanh(x @ params["w"] + params["b"])
    return {"loss": jnp.mean((pred - y) ** 2), "pred": (pred,)}


PARAMS = {"w": jnp.ones((8, 4)) / 8, "b": jnp.zeros(4)}
BATCH = (X, jnp.ones((40, 4)))


def test_lower_compile_call_on_pytrees():
    f = memsafe.jit(loss, memory_limit="1MiB")
    compiled = f.lower(PARAMS, BATCH).compile()
    assert_like_jit(compiled(PARAMS, BATCH), loss, PARAMS, BATCH)
    assert (
        compiled.memory_analysis().argument_size_in_bytes == f.plan(PARAMS, BATCH).after.arguments
    )
    assert "memsafe.stages.Compiled(loss" in repr(compiled)


def test_compiled_is_the_executable_memsafe_measured():
    f = memsafe.jit(loss, memory_limit="1MiB")
    lowered = f.lower(PARAMS, BATCH)
    assert lowered.compile().runtime_executable() is not None
    program = f._planned((PARAMS, BATCH), {})[0]
    assert lowered.compile()._program.compiled is program.compiled
    assert "stablehlo" in lowered.as_text() or "func" in lowered.as_text()


def test_compiled_with_static_arguments_left_out_or_repeated():
    f = memsafe.jit(knn, memory_limit="4MiB", static_argnames="k")
    compiled = f.lower(X, Y, k=4).compile()
    want = knn(X, Y, 4)
    _close(compiled(X, Y), want)  # as jax.jit's compiled functions are called
    _close(compiled(X, Y, k=4), want)


def test_compiled_called_with_other_arguments_says_so():
    f = memsafe.jit(loss, memory_limit="1MiB")
    compiled = f.lower(PARAMS, BATCH).compile()
    with pytest.raises(TypeError) as info:
        compiled(PARAMS, (X[:10], BATCH[1][:10]))
    assert (
        "memsafe: loss was compiled for arguments (float32[4], float32[8, 4], float32[40, 8]"
        in (str(info.value))
    )
    assert "lower it again for these arguments" in str(info.value)


def test_trace_gives_the_program_that_runs_and_lowers():
    f = memsafe.jit(knn, memory_limit="4MiB", static_argnums=2)
    traced = f.trace(X, Y, 5)
    assert traced.fun_name == "knn"
    assert [tuple(o.shape) for o in traced.out_info] == [(40, 5), (40, 5)]
    assert traced.jaxpr is f._planned((X, Y, 5), {})[0].closed
    _close(traced.lower().compile()(X, Y), knn(X, Y, 5))


def test_eval_shape_matches_jax_and_plans_nothing():
    f = memsafe.jit(loss, memory_limit="1KiB")  # far too small: eval_shape must not plan
    got = f.eval_shape(PARAMS, BATCH)
    want = jax.eval_shape(loss, PARAMS, BATCH)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    assert all(
        a.shape == b.shape and a.dtype == b.dtype
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want))
    )
    assert not f._programs


def test_donate_argnames_aliases_the_buffer():
    def step(state, delta):
        return {"a": state["a"] + delta, "b": state["b"] * 2}

    state = {"a": jnp.ones(10_000), "b": jnp.ones(10_000)}
    f = memsafe.jit(step, memory_limit="1MiB", donate_argnames="state")
    assert f.donate_argnums == (0,)
    plan = f.plan(state, jnp.ones(10_000))
    assert plan.after.aliases == 80_000  # both leaves of state reused for the outputs
    out = f(state, jnp.ones(10_000))
    np.testing.assert_allclose(out["a"], 2.0)
    assert state["a"].is_deleted()


def test_compiler_options_merge_with_memsafes(monkeypatch):
    seen = []
    real_jit = jax.jit

    def spy(fun, **kwargs):
        seen.append(kwargs.get("compiler_options"))
        return real_jit(fun, **kwargs)

    monkeypatch.setattr(jax, "jit", spy)
    extra = {"xla_cpu_enable_fast_math": False}
    memsafe.jit(lambda x: x * 2, memory_limit="1MiB", compiler_options=extra)(jnp.ones(4))
    assert seen[-1] == {**compiler_options(), **extra}
    override = dict.fromkeys(CPU_COMPILER_OPTIONS, "set by the user")
    assert merged_options(override) == override  # the user's explicit value wins


def test_repr_wraps_and_binds_as_a_method():
    f = memsafe.jit(knn, memory_limit="4MiB", static_argnames="k")
    assert repr(f) == (
        "memsafe.jit(knn, memory_limit=4.0 MiB, static_argnums=(2,), static_argnames=('k',), "
        "0 plans)"
    )
    assert f.__wrapped__ is knn and f.__name__ == "knn" and f.__doc__ == knn.__doc__
    f(X, Y, k=2)
    assert repr(f).endswith("1 plan)")

    class Model:
        scale = 3.0

        @functools.partial(memsafe.jit, memory_limit="1MiB")
        def apply(self, x):
            return x * 3.0

    np.testing.assert_allclose(Model().apply(jnp.ones(2)), 3.0)


@pytest.mark.parametrize(
    "transform",
    [
        lambda f, x: jax.jvp(f, (x,), (x,)),
        lambda f, x: jax.jacfwd(f)(x),
        lambda f, x: jax.jit(lambda x: jax.jvp(f, (x,), (x,)))(x),
    ],
    ids=["jvp", "jacfwd", "jit-of-jvp"],
)
def test_forward_mode_gets_memsafes_explanation(transform):
    def f(x):
        return jnp.sin(x) * 2

    with pytest.raises(memsafe.ForwardModeError) as info:
        transform(memsafe.jit(f, memory_limit="1MiB"), jnp.ones(3))
    message = str(info.value)
    assert "forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize) cannot go" in message
    assert "memsafe.jit(lambda x, t: jax.jvp(f, (x,), (t,)), memory_limit=...)" in message
    assert isinstance(info.value, TypeError)  # what JAX raised before, so except clauses hold


def test_forward_mode_workaround_and_reverse_mode_work():
    def f(x):
        return jnp.sin(x) * 2

    x = jnp.linspace(0, 1, 5)
    safe = memsafe.jit(lambda x, t: jax.jvp(f, (x,), (t,)), memory_limit="1MiB")
    _close(safe(x, jnp.ones(5)), jax.jvp(f, (x,), (jnp.ones(5),)))
    _close(jax.jacrev(memsafe.jit(f, memory_limit="1MiB"))(x), jax.jacfwd(f)(x))
    assert "forward mode (jax.jvp, jax.jacfwd, jax.linearize)" in str(
        memsafe.jit(f, memory_limit="1MiB").plan(x)
    )
