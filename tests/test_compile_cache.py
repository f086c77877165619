"""Compile cost: programs shared across wrappers (memsafe.cache), never stale; XLA compiles
counted; the dispatch fast path; JAX's persistent compilation cache honoured."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe import cache, search
from memsafe.rules import Rule, register_rule, unregister_rule
from memsafe.xla import compiler_options, memsafe_jit
from tests.compiles import Compiles

N, M, D = 512, 2048, 8
LIMIT = "2MiB"  # the 512 x 2048 product (4 MiB) must be split


def _kernel_sum(x, y, v):
    return jnp.exp(-(x @ y.T)) @ v


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, D)).astype(np.float32) / 4
    y = rng.normal(size=(M, D)).astype(np.float32) / 4
    v = rng.normal(size=(M,)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(y), jnp.asarray(v)


def _compiles_during(fn):
    compiler_options()  # memsafe's one probe compile (whether YNNPACK can be turned off) done
    before = Compiles.count
    out = jax.block_until_ready(fn())
    return out, Compiles.count - before


def _close(a, b):
    """Equal up to float32 rounding of sums in another order (chunks)."""
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(np.max(np.abs(b))))


def test_first_call_compiles_each_attempt_once_and_the_call_reuses_the_executable():
    x, y, v = _inputs()
    safe = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    out, n = _compiles_during(lambda: safe(x, y, v))
    plan = safe.plan(x, y, v)
    assert not plan.fits_unchanged and plan.splits
    assert n == 1 + len(plan.attempts)  # the original program, then each attempt: no re-lowering
    _close(out, memsafe_jit(_kernel_sum)(x, y, v))
    _, again = _compiles_during(lambda: safe(x, y, v))
    assert again == 0


def test_a_second_wrapper_of_the_same_function_and_limit_compiles_nothing():
    x, y, v = _inputs()
    first = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    expected = first(x, y, v)
    second = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    out, n = _compiles_during(lambda: second(x, y, v))
    assert n == 0
    _close(out, expected)
    assert str(second.plan(x, y, v)) == str(first.plan(x, y, v))
    assert second.plan(x, y, v) is not first.plan(x, y, v)  # each function its own plan
    # another limit, or other shapes, is another program
    other = memsafe.jit(_kernel_sum, memory_limit="3MiB")
    _, n_other = _compiles_during(lambda: other(x, y, v))
    assert n_other >= 1


def test_closures_over_different_arrays_never_share_a_program():
    x, y, v = _inputs()

    def make(weights):
        def f(x, y):
            return jnp.exp(-(x @ y.T)) @ weights

        return f

    v2 = v[::-1] * 3.0
    for w in (v, v2):
        got = memsafe.jit(make(w), memory_limit=LIMIT)(x, y)
        _close(got, memsafe_jit(make(w))(x, y))


def test_a_rebound_global_or_cell_and_an_array_changed_in_place_are_seen():
    x, y, v = _inputs()
    weights = {"w": np.asarray(v).copy()}

    def f(x, y):
        return jnp.exp(-(x @ y.T)) @ weights["w"]

    ref = memsafe_jit(lambda x, y, w: jnp.exp(-(x @ y.T)) @ w)
    _close(memsafe.jit(f, memory_limit=LIMIT)(x, y), ref(x, y, weights["w"]))
    weights["w"] = np.asarray(v)[::-1].copy()  # rebound: another NumPy constant
    _close(memsafe.jit(f, memory_limit=LIMIT)(x, y), ref(x, y, weights["w"]))
    weights["w"] *= 2.0  # the same NumPy array, changed in place
    _close(memsafe.jit(f, memory_limit=LIMIT)(x, y), ref(x, y, weights["w"]))
    scale = 1.0

    def g(x, y):
        return jnp.exp(-(x @ y.T)) @ v * scale  # a Python float: a literal of the program

    _close(memsafe.jit(g, memory_limit=LIMIT)(x, y), ref(x, y, v))
    scale = 2.0
    _close(memsafe.jit(g, memory_limit=LIMIT)(x, y), ref(x, y, v) * 2.0)


def test_functions_tracing_alike_keep_their_own_output_structure():
    x, y, v = _inputs()

    def as_tuple(x, y, v):
        return (_kernel_sum(x, y, v),)

    def as_dict(x, y, v):
        return {"out": _kernel_sum(x, y, v)}

    a = memsafe.jit(as_tuple, memory_limit=LIMIT)(x, y, v)
    _, n = _compiles_during(lambda: memsafe.jit(as_dict, memory_limit=LIMIT)(x, y, v))
    b = memsafe.jit(as_dict, memory_limit=LIMIT)(x, y, v)
    assert n == 0 and isinstance(a, tuple) and set(b) == {"out"}
    _close(a[0], b["out"])


def test_a_registered_rule_changes_the_key():
    x, y, v = _inputs()
    memsafe.jit(_kernel_sum, memory_limit=LIMIT)(x, y, v)
    rule = Rule("test_cache_abs_abs", lambda a: jnp.abs(jnp.abs(a)), jnp.abs, shapes="n")
    register_rule(rule)
    try:
        _, n = _compiles_during(lambda: memsafe.jit(_kernel_sum, memory_limit=LIMIT)(x, y, v))
    finally:
        unregister_rule(rule.name)
    assert n >= 1


def test_gradients_are_shared_and_right():
    x, y, v = _inputs()

    def loss(x, y, v):
        return jnp.sum(_kernel_sum(x, y, v) ** 2)

    expected = jax.grad(loss)(x, y, v)
    first = jax.grad(memsafe.jit(loss, memory_limit=LIMIT))(x, y, v)
    got, n = _compiles_during(lambda: jax.grad(memsafe.jit(loss, memory_limit=LIMIT))(x, y, v))
    assert n == 0
    _close(first, expected)
    _close(got, expected)


def test_the_cache_is_bounded_and_cleared():
    store = cache.ProgramCache(max_entries=2)
    x, y, v = _inputs()
    safe = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    safe(x, y, v)
    (program,) = safe._programs.values()
    keys = [cache.ProgramKey(str(i), (), (), ()) for i in range(3)]
    for key in keys:
        store.put(key, program, ())
    assert len(store) == 2 and store.get(keys[0]) is None and store.get(keys[2]) is not None
    assert store.get(keys[2]).plan is not store.get(keys[2]).plan
    store.clear()
    assert len(store) == 0


def test_fast_path_answers_as_the_slow_path_for_shapes_weak_types_and_tracers():
    safe = memsafe.jit(lambda a, b: a * b + 1, memory_limit="1MiB")
    a, b = jnp.arange(4.0), jnp.ones(4)
    for _ in range(2):  # second call takes the fast path
        _close(safe(a, b), a * b + 1)
    _close(safe(jnp.arange(6.0), jnp.ones(6)), jnp.arange(6.0) + 1)  # a new shape
    bf16 = jnp.ones((), jnp.bfloat16)
    plain = jax.jit(lambda a, b: a * b + 1)
    weak, strong = jnp.asarray(2.0), jnp.asarray(2.0, dtype=jnp.float32)
    assert weak.weak_type and not strong.weak_type
    for first, then in ((weak, strong), (strong, weak)):  # the same shapes, other weak types
        for arg in (first, first, then):
            assert safe(arg, bf16).dtype == plain(arg, bf16).dtype
    assert safe(np.arange(4.0, dtype=np.float32), np.ones(4, np.float32)).shape == (4,)
    assert safe(a, 2.0).shape == (4,)  # a Python scalar: the slow path
    grad = jax.grad(lambda a: jnp.sum(safe(a, b)))(a)
    _close(grad, b)
    with pytest.raises(TypeError):
        safe(a, jnp.ones(3))  # the error jax.numpy gives for incompatible shapes


PERSISTENT = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    events = []
    jax.monitoring.register_event_listener(lambda e, **_: events.append(e))
    import memsafe
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32) / 4
    y = rng.normal(size=(2048, 8)).astype(np.float32) / 4
    v = rng.normal(size=(2048,)).astype(np.float32)
    f = memsafe.jit(lambda x, y, v: jnp.exp(-(x @ y.T)) @ v, memory_limit="2MiB")
    out = f(x, y, v)
    print(json.dumps({
        "hits": events.count("/jax/compilation_cache/cache_hits"),
        "misses": events.count("/jax/compilation_cache/cache_misses"),
        "splits": len(f.plan(x, y, v).splits),
        "out": np.asarray(out).tolist(),
    }))
    """
)


def _run_persistent(cache_dir):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", PERSISTENT, str(cache_dir)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_jax_persistent_compilation_cache_holds_memsafe_executables(tmp_path):
    first = _run_persistent(tmp_path)
    assert first["splits"] >= 1 and first["misses"] >= 2 and first["hits"] == 0
    assert any(tmp_path.iterdir())
    second = _run_persistent(tmp_path)
    assert second["hits"] >= 2 and second["misses"] == 0  # the original and the split program
    assert second["out"] == first["out"]


def _knn(x, y):
    return jax.lax.top_k(-(x @ y.T), 5)


@pytest.mark.parametrize("fun", [_kernel_sum, _knn], ids=["one output", "two outputs"])
def test_compiling_the_original_beside_the_first_attempt_changes_no_plan(fun, monkeypatch, caplog):
    """Speculation (the original compiled in a worker while the first attempt is planned from
    the fixed bytes expected) gives the plan of compiling first, with no extra compile."""
    x, y, v = _inputs()
    args = (x, y, v) if fun is _kernel_sum else (x, y)
    caplog.set_level(logging.INFO, logger="memsafe")
    speculative = memsafe.jit(fun, memory_limit=LIMIT)
    out, n = _compiles_during(lambda: speculative(*args))
    plan = speculative.plan(*args)
    assert plan.splits and n == 1 + len(plan.attempts)
    order = [m for r in caplog.records for m in ("attempt 1", "original") if m in r.getMessage()]
    assert order[:2] == ["attempt 1", "original"]  # the attempt was made beside the original
    cache.clear()
    monkeypatch.setattr(
        search, "SEARCH", dataclasses.replace(search.SEARCH, speculate_above=float("inf"))
    )
    sequential = memsafe.jit(fun, memory_limit=LIMIT)
    expected = sequential(*args)
    assert str(sequential.plan(*args)) == str(plan)
    for a, b in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_arguments_over_the_limit_are_refused_after_one_compile(caplog):
    """Where the arguments alone exceed the limit, no attempt is made beside the original: its
    compile ends in the refusal (an attempt without room can be slow to compile on a GPU)."""
    x, y, _ = _inputs()
    caplog.set_level(logging.INFO, logger="memsafe")
    small = memsafe.jit(_knn, memory_limit=x.nbytes + y.nbytes - 1)
    with pytest.raises(memsafe.MemoryLimitError, match="arguments and outputs alone"):
        small(x, y)
    messages = [r.getMessage() for r in caplog.records]
    assert any("original program compiled" in m for m in messages), messages
    assert not any("attempt 1" in m for m in messages), messages
