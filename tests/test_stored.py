"""Verified programs kept in the plan store (memsafe.stored): a second process loads the stored
executable (or, where it does not load, compiles the stored program once) instead of searching,
with the first process's footprint and answers; what does not load or no longer fits is planned
anew."""

from __future__ import annotations

import json
import logging
import os
import pickle
import pickletools
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe import _jax, cache, plan_store, stored
from memsafe.rules import Rule, register_rule, unregister_rule

LIMIT = "2MiB"  # the 512 x 2048 product (4 MiB) must be split


def _kernel_sum(x, y, v):
    return jnp.exp(-(x @ y.T)) @ v


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32) / 4
    y = rng.normal(size=(2048, 8)).astype(np.float32) / 4
    v = rng.normal(size=(2048,)).astype(np.float32)
    return x, y, v


@pytest.fixture
def store(tmp_path):
    """The plan store on in a fresh directory, off again after the test."""
    plan_store.set_cache_dir(tmp_path / "store")
    yield tmp_path / "store"
    plan_store.set_cache_dir(None)


# What one process does: plan (or load) the kernel sum and its gradient, and report.
_SCRIPT = textwrap.dedent(
    """
    import json, logging, sys
    import jax, jax.numpy as jnp, numpy as np
    import memsafe

    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _d, **_: compiles.append(1)
        if event == "/jax/core/compile/backend_compile_duration" else None
    )
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("memsafe").addHandler(handler)
    logging.getLogger("memsafe").setLevel(logging.INFO)

    def kernel_sum(x, y, v):
        return jnp.exp(-(x @ y.T)) @ v

    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32) / 4
    y = rng.normal(size=(2048, 8)).astype(np.float32) / 4
    v = rng.normal(size=(2048,)).astype(np.float32)
    memsafe.xla.compiler_options()  # the one probe compile, done before counting
    compiles.clear()
    f = memsafe.jit(kernel_sum, memory_limit="2MiB")
    plan = f.plan(x, y, v)
    backward = f.backward_plan(x, y, v)  # of every input: what jax.grad below runs
    planning = len(compiles)
    times = [(p.time.origin, [w for w, _ in p.time.compiles], p.time.loaded > 0)
             for p in (plan, backward)]
    out = np.asarray(f(x, y, v))
    grads = jax.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2))(x, y, v)
    grad = np.concatenate([np.asarray(g).ravel() for g in grads])
    print(json.dumps({
        "out": out.tobytes().hex(), "grad": grad.tobytes().hex(),
        "after": plan.after.total, "backward": backward.after.total,
        "plan": str(plan), "compiles": planning, "messages": messages, "times": times,
    }))
    """
)


def _process(directory: Path) -> dict:
    env = {**os.environ, "MEMSAFE_CACHE_DIR": str(directory), "JAX_PLATFORMS": "cpu"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(memsafe.__file__).parents[1]), os.getcwd()])
    run = subprocess.run(
        [sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_second_process_runs_the_stored_executables_without_compiling(tmp_path):
    first = _process(tmp_path / "store")
    second = _process(tmp_path / "store")
    assert not any("loaded from the plan store" in m for m in first["messages"])
    loaded = [m for m in second["messages"] if "loaded from the plan store" in m]
    assert len(loaded) == 2, second["messages"]  # the function and its gradient
    executables = [m for m in second["messages"] if "stored executable loaded" in m]
    assert len(executables) == 2, second["messages"]
    # the first searched (the original, then attempts, for each program); the second loaded
    # each stored executable and compiled nothing to plan
    assert first["compiles"] >= 4
    assert second["compiles"] == 0, second["messages"]
    assert second["times"] == [["loaded", [], True]] * 2
    for k in ("out", "grad", "after", "backward", "plan"):
        assert first[k] == second[k], k
    assert len(list((tmp_path / "store").glob("*.plan"))) == 2


def test_every_setting_of_the_plan_is_in_the_key(store):
    x, y, v = _inputs()
    memsafe.jit(_kernel_sum, memory_limit=LIMIT)(x, y, v)
    assert len(list(store.glob("*.plan"))) == 1
    closed = jax.make_jaxpr(_kernel_sum)(x, y, v)
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (x, y, v)]
    base = dict(memory_limit=2 << 20, donate=(), compiler_options=None, on_mesh=None)
    key = stored.key_of(closed, None, avals, **base)
    assert key is not None and (store / f"{key}.plan").exists()
    others = [
        dict(base, memory_limit=3 << 20),
        dict(base, donate=(0,)),
        dict(base, compiler_options={"xla_cpu_enable_fast_math": True}),
    ]
    keys = {stored.key_of(closed, None, avals, **o) for o in others}
    keys.add(stored.key_of(closed, closed, avals, **base))  # another start of the rewrite
    keys.add(
        stored.key_of(jax.make_jaxpr(lambda *a: _kernel_sum(*a) * 2)(x, y, v), None, avals, **base)
    )
    assert key not in keys and len(keys) == 5
    assert stored.key_of(closed, None, avals, **dict(base, on_mesh=object())) is None


def test_a_hit_in_process_skips_the_search_with_the_same_answer(store, caplog):
    x, y, v = _inputs()
    first = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    want = np.asarray(first(x, y, v))
    cache.clear()  # the in-memory cache would answer first
    second = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    with caplog.at_level(logging.INFO, logger="memsafe"):
        got = np.asarray(second(x, y, v))
    assert any("loaded from the plan store" in r.getMessage() for r in caplog.records)
    np.testing.assert_array_equal(got, want)
    planned, loaded = first.plan(x, y, v), second.plan(x, y, v)
    assert loaded.after.total == planned.after.total
    # the time by phase: the search's passes and compiles, then the one compile of the load
    assert planned.time.origin == "planned" and planned.time.total > 0
    assert "split" in planned.time.passes and len(planned.time.compiles) >= 2
    assert loaded.time.origin == "loaded" and not loaded.time.passes
    assert loaded.time.compiles == [] and loaded.time.loaded > 0  # the executable, not compiled
    assert "loaded from the plan store" in loaded.time.describe()
    assert "executable loaded" in loaded.time.describe()


def test_an_entry_that_does_not_load_is_planned_anew(store, caplog):
    x, y, v = _inputs()
    want = np.asarray(memsafe.jit(_kernel_sum, memory_limit=LIMIT)(x, y, v))
    (path,) = store.glob("*.plan")
    plan_store.save(path.stem, b"not a pickle", {})  # a well-formed entry, a bad payload
    _, got, messages = _planned_again(x, y, v, caplog)
    assert any("did not load" in m for m in messages), messages
    assert any("planned in" in m for m in messages), messages
    np.testing.assert_array_equal(got, want)
    assert plan_store.load(path.stem).payload != b"not a pickle"  # stored again


def _planned_again(x: Any, y: Any, v: Any, caplog: Any) -> tuple[Any, np.ndarray, list[str]]:
    """A fresh memsafe function of the kernel sum after the in-memory cache is cleared, its
    result on ``(x, y, v)`` and the messages it logged meanwhile."""
    cache.clear()
    f = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    with caplog.at_level(logging.INFO, logger="memsafe"):
        got = np.asarray(f(x, y, v))
    return f, got, [r.getMessage() for r in caplog.records]


def _stored(path: Path) -> dict:
    """The payload saved in the entry at ``path``, unpickled."""
    return pickle.loads(plan_store.load(path.stem).payload)


def _restore(path: Path, payload: dict) -> None:
    """Save ``payload`` (changed) back under the entry at ``path``: a well-formed entry."""
    plan_store.save(path.stem, pickle.dumps(payload), {})


def _garbled(data: bytes) -> bytes:
    """The stored executable with XLA's own bytes (the longest bytes object in its pickle)
    zeroed: a pickle that unpickles, holding an executable XLA cannot read."""
    payload, in_tree, out_tree = pickle.loads(data)
    longest = max(
        (arg for op, arg, _ in pickletools.genops(payload) if isinstance(arg, bytes)), key=len
    )
    garbled = payload.replace(longest, bytes(len(longest)))
    assert len(garbled) == len(payload) and garbled != payload
    return pickle.dumps((garbled, in_tree, out_tree))


def _foreign(_data: bytes) -> bytes:
    """Another program's executable (other shapes), as if stored under this key."""
    compiled = jax.jit(lambda a: a + 1).lower(np.ones(3, np.float32)).compile()
    return _jax.serialize_executable(compiled)


@pytest.mark.parametrize(
    "spoil",
    [lambda d: d[: len(d) // 2], lambda d: d[:-7], _garbled, _foreign],
    ids=["truncated", "cut-short", "garbled", "foreign"],
)
def test_an_executable_that_does_not_load_compiles_the_stored_program(store, caplog, spoil):
    x, y, v = _inputs()
    first = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    want = np.asarray(first(x, y, v))
    (path,) = store.glob("*.plan")
    payload = _stored(path)
    assert isinstance(payload["executable"], bytes)
    _restore(path, {**payload, "executable": spoil(payload["executable"])})
    f, got, messages = _planned_again(x, y, v, caplog)
    assert any("stored executable did not load" in m for m in messages), messages
    assert any("loaded from the plan store" in m for m in messages), messages
    np.testing.assert_array_equal(got, want)
    plan = f.plan(x, y, v)
    assert [what for what, _ in plan.time.compiles] == ["stored program"]
    assert plan.after == first.plan(x, y, v).after


def _add_kernel(x, y):
    return x + jnp.exp(-(x @ y.T)) @ y  # the result has x's shape: x's buffer can hold it


def test_a_donated_argument_stays_donated_when_loaded(store):
    x, y, _ = _inputs()
    first = memsafe.jit(_add_kernel, memory_limit=LIMIT, donate_argnums=0)
    given = jnp.asarray(x)
    want = np.asarray(first(given, y))
    assert given.is_deleted()
    planned = first.plan(jax.ShapeDtypeStruct(x.shape, x.dtype), y)
    assert planned.after.aliases > 0
    cache.clear()
    second = memsafe.jit(_add_kernel, memory_limit=LIMIT, donate_argnums=0)
    given = jnp.asarray(x)
    got = np.asarray(second(given, y))
    loaded = second.plan(jax.ShapeDtypeStruct(x.shape, x.dtype), y)
    assert loaded.time.origin == "loaded" and loaded.time.compiles == []
    assert given.is_deleted()  # the loaded executable took x's buffer
    np.testing.assert_array_equal(got, want)
    assert loaded.after == planned.after


@pytest.mark.parametrize("executable", [True, False], ids=["executable", "export-only"])
def test_a_stored_program_over_the_limit_is_not_trusted(store, caplog, monkeypatch, executable):
    x, y, v = _inputs()
    memsafe.jit(_kernel_sum, memory_limit=LIMIT)(x, y, v)
    if not executable:  # an entry from a backend that cannot serialize its executables
        (path,) = store.glob("*.plan")
        _restore(path, {**_stored(path), "executable": None})
    cache.clear()
    real = stored.compile_measured

    def bigger(*args, **kwargs):  # as if this machine's XLA now kept more for it
        got = real(*args, **kwargs)
        footprint = type(got.footprint)(**{**got.footprint.__dict__, "temps": 1 << 30})
        return type(got)(got.jitted, got.compiled, footprint)

    measured = stored.Footprint

    class Bigger(measured):  # the same, for the loaded executable's measure
        @classmethod
        def from_compiled(cls, compiled, hidden_constants=0):
            got = measured.from_compiled(compiled, hidden_constants)
            return measured(**{**got.__dict__, "temps": 1 << 30})

    monkeypatch.setattr(stored, "compile_measured", bigger)
    monkeypatch.setattr(stored, "Footprint", Bigger)
    f = memsafe.jit(_kernel_sum, memory_limit=LIMIT)
    with caplog.at_level(logging.INFO, logger="memsafe"):
        f(x, y, v)
    messages = [r.getMessage() for r in caplog.records]
    assert any("no longer fits" in m for m in messages), messages
    plan = f.plan(x, y, v)
    assert plan.time.origin != "loaded" and plan.after.total <= 2 << 20


def test_programs_that_fit_unchanged_or_use_user_rules_are_not_stored(store):
    x, y, v = _inputs()
    memsafe.jit(_kernel_sum, memory_limit="1GiB")(x, y, v)
    assert not list(store.glob("*.plan"))
    rule = Rule("test_stored_abs_abs", lambda a: jnp.abs(jnp.abs(a)), jnp.abs, shapes="n")
    register_rule(rule)
    try:
        memsafe.jit(_kernel_sum, memory_limit=LIMIT)(x, y, v)
    finally:
        unregister_rule(rule)
    assert not list(store.glob("*.plan"))
