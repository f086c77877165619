"""The attempt loop (memsafe.search.Search): where the passes' size model counts less than XLA
keeps, the first attempt may change nothing; the next attempts plan under smaller budgets
until the passes act, and compile only programs that differ from the last one compiled."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import memsafe
from memsafe import policy, search
from memsafe.split import planner
from memsafe.xla import Footprint, memsafe_jit
from tests.agree import assert_like_jit


def _deep(x, ws):
    """A chain of dense layers on [n, m] values: its gradient holds every layer's activation for
    the backward, each well under a quarter of the budgets below."""
    h = x
    for w in ws:
        h = jnp.tanh(h @ w)
    return jnp.sum(h**2)


def _args():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4096, 128)).astype(np.float32)
    ws = [rng.standard_normal((128, 128)).astype(np.float32) / 11 for _ in range(8)]
    return x, ws


def _undercounting(monkeypatch, factor: float) -> None:
    """The split pass's size model reads ``factor`` times the estimated peak."""
    real = planner.estimate

    def estimate(graph):
        got = real(graph)
        return dataclasses.replace(got, peak_bytes=int(got.peak_bytes * factor))

    monkeypatch.setattr(planner, "estimate", estimate)


def test_a_first_attempt_that_changes_nothing_is_followed_by_smaller_budgets(monkeypatch):
    x, ws = _args()
    grad = jax.grad(_deep, argnums=1)
    need = Footprint.from_compiled(memsafe_jit(grad).lower(x, ws).compile()).total
    limit = int(need * 0.6)
    _undercounting(monkeypatch, 0.25)  # the model sees the program well under the limit
    f = memsafe.jit(grad, memory_limit=limit)
    plan = f.plan(x, ws)
    assert plan.after.total <= limit < need, plan
    assert plan.splits, plan
    assert len(plan.attempts) >= 2 and plan.attempts[0].footprint.total > limit, plan.attempts
    assert_like_jit(f(x, ws), grad, x, ws)


def _fori_layers(ws, x):
    """Layers as a ``fori_loop``: its gradient's chunks hold each layer's gradient and the
    loop's carries, which the size model counts far above what XLA keeps."""
    h = jax.lax.fori_loop(0, len(ws), lambda i, h: jnp.tanh(h @ ws[i]), x)
    return jnp.sum(h**2)


def _fori_gradient() -> tuple[Any, tuple]:
    rng = np.random.default_rng(1)
    ws = (rng.standard_normal((6, 256, 256)) / 16).astype(np.float32)
    x = rng.standard_normal((4096, 256)).astype(np.float32)
    return jax.grad(_fori_layers, argnums=(0, 1)), (ws, x)


def test_smallest_chunks_that_fit_with_room_to_spare_are_grown(monkeypatch):
    """The size model expects no chunk to fit (its accumulators counted thrice); floored at the
    sinks' smallest chunk, the compile uses under half the room: a larger chunk scale is tried,
    and the program that fits with the larger chunks is kept (measured: 4096 chunks of 1 row in
    1.8 MiB of 5 MiB room; then chunks of 94 in 4.4 MiB, 7.7x faster)."""
    floored = dataclasses.replace(policy.SPLIT, floor_part=2**60)  # chunks: the sinks' smallest
    monkeypatch.setattr(policy, "SPLIT", floored)
    grad, args = _fori_gradient()
    memsafe.cache.clear()
    f = memsafe.jit(grad, memory_limit="16MiB")
    plan = f.plan(*args)
    (split,) = plan.splits
    assert plan.after.total <= 16 * 2**20 and split.chunk > 1, plan
    grown = [a for a in plan.attempts if a.note.startswith("grown")]
    assert grown and grown[-1].fits and grown[-1].chunk_scale > 1, plan.attempts
    assert_like_jit(f(*args), grad, *args)


def test_floored_chunks_take_a_part_of_the_budget():
    """The same program as planned by default: its floored chunk takes up to a
    ``policy.SPLIT.floor_part``-th of the budget by itself (not one row), and the first attempt
    fits."""
    grad, args = _fori_gradient()
    memsafe.cache.clear()
    f = memsafe.jit(grad, memory_limit="16MiB")
    plan = f.plan(*args)
    (split,) = plan.splits
    assert split.floored and split.chunk > 1, plan
    assert len(plan.attempts) == 1 and plan.attempts[0].fits, plan.attempts
    assert_like_jit(f(*args), grad, *args)


def test_an_attempt_that_fits_far_below_the_limit_after_one_over_it_is_refilled(monkeypatch):
    """Retries at least halve the chunk scale: one that lands far below the limit after an
    attempt over it is followed by one at the scale interpolated between the two, kept where it
    fits (fewer, larger chunks; measured here: 4.4 MiB at a quarter of the scale, then 8.7 MiB
    under 13.2 MiB)."""
    x, ws = _args()
    grad = jax.grad(_deep, argnums=1)
    need = Footprint.from_compiled(memsafe_jit(grad).lower(x, ws).compile()).total
    limit = int(need * 0.6)
    _undercounting(monkeypatch, 0.25)  # the first attempt is over the limit
    monkeypatch.setattr(search, "next_scale", lambda scale, *_: scale / 4)
    f = memsafe.jit(grad, memory_limit=limit)
    plan = f.plan(x, ws)
    over, shrunk, refill = plan.attempts[:3]
    assert not over.fits and shrunk.fits, plan.attempts
    assert refill.note == "grown: between the last two attempts", plan.attempts
    assert shrunk.chunk_scale < refill.chunk_scale < over.chunk_scale, plan.attempts
    assert refill.fits and plan.after.total == refill.footprint.total <= limit, plan.attempts
    assert refill.footprint.total > shrunk.footprint.total, plan.attempts
    assert_like_jit(f(x, ws), grad, x, ws)


def _failing_compiles(
    monkeypatch, how_many: int, text: str = "INTERNAL: RET_CHECK failure"
) -> list:
    """The first ``how_many`` attempt compiles raise as XLA does when it fails itself (as its CPU
    fusion emitter did on a split program: "Failed to translate module to LLVM IR")."""
    real, calls = search.compile_measured, []

    def compile_measured(fun, avals, options, donate, hidden, what):
        calls.append(what[1])
        if what[1].startswith("attempt") and len(calls) <= how_many:
            raise jax.errors.JaxRuntimeError(f"{text} (external/xla/...) injected")
        return real(fun, avals, options, donate, hidden, what)

    monkeypatch.setattr(search, "compile_measured", compile_measured)
    return calls


def test_an_attempt_xla_fails_to_compile_is_followed_by_the_next(monkeypatch, caplog):
    x, ws = _args()
    grad = jax.grad(_deep, argnums=1)
    need = Footprint.from_compiled(memsafe_jit(grad).lower(x, ws).compile()).total
    limit = int(need * 0.6)
    calls = _failing_compiles(monkeypatch, 1)
    f = memsafe.jit(grad, memory_limit=limit)
    with caplog.at_level("WARNING", logger="memsafe"):
        plan = f.plan(x, ws)
    assert plan.after.total <= limit, plan
    assert len(calls) >= 2 and calls[0].startswith("attempt 1"), calls
    assert "XLA failed to compile attempt 1" in caplog.text
    assert_like_jit(f(x, ws), grad, x, ws)


def test_where_xla_compiles_no_attempt_the_error_says_so(monkeypatch):
    x, ws = _args()
    grad = jax.grad(_deep, argnums=1)
    need = Footprint.from_compiled(memsafe_jit(grad).lower(x, ws).compile()).total
    _failing_compiles(monkeypatch, 10**6)
    f = memsafe.jit(grad, memory_limit=int(need * 0.6))
    try:
        f.plan(x, ws)
    except memsafe.MemoryLimitError as err:
        assert "XLA could not compile any program memsafe planned" in str(err), err
        assert "RET_CHECK failure" in str(err), err
    else:
        raise AssertionError("planned without a compile")


def test_an_error_of_the_program_itself_is_not_retried(monkeypatch):
    x, ws = _args()
    grad = jax.grad(_deep, argnums=1)
    need = Footprint.from_compiled(memsafe_jit(grad).lower(x, ws).compile()).total
    calls = _failing_compiles(monkeypatch, 1, text="INVALID_ARGUMENT: a bad program")
    f = memsafe.jit(grad, memory_limit=int(need * 0.6))
    try:
        f.plan(x, ws)
    except jax.errors.JaxRuntimeError as err:
        assert "INVALID_ARGUMENT" in str(err)
    else:
        raise AssertionError("an error of the program was swallowed")
    assert len(calls) == 1, calls
