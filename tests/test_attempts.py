"""The attempt loop (memsafe.jit._Search): where the passes' size model counts less than XLA
keeps, the first attempt may change nothing; the next attempts plan under smaller budgets
until the passes act, and compile only programs that differ from the last one compiled."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import memsafe
from memsafe.passes import split as split_pass
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
    real = split_pass.estimate

    def estimate(graph):
        got = real(graph)
        return dataclasses.replace(got, peak_bytes=int(got.peak_bytes * factor))

    monkeypatch.setattr(split_pass, "estimate", estimate)


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
