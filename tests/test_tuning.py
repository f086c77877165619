"""The CPU's trusted YNNPACK type, timed over a program's first calls (memsafe.tuning): its
products give XLA's NaN and infinities, and the trial keeps the faster executable, within the
limit, with jax.jit's answers."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe import policy, tuning
from memsafe.plan import Plan
from memsafe.xla import Footprint, memsafe_jit
from tests.agree import assert_like_jit

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="YNNPACK is the CPU's")

CANDIDATE = tuning.CANDIDATE


def _products(a, b):
    return a @ b, jnp.einsum("nk,mk->nm", a, b.T) + 1.0


@pytest.mark.parametrize("special", [np.inf, -np.inf, np.nan])
def test_the_candidates_products_have_xlas_nan_and_infinities(special):
    """Products with inf, -inf or NaN factors (and zeros, so inf * 0 occurs), compiled with the
    candidate and with YNNPACK off: NaN, +inf and -inf at the same places, finite values close.
    (Near float32's largest value the two may sum in another order, so one can overflow where
    the other does not, as a chunked sum can: not tested here.)"""
    rng = np.random.default_rng(0)
    for _ in range(40):
        n, k, m = rng.integers(1, 70, 3)
        a = rng.standard_normal((n, k)).astype(np.float32)
        b = rng.standard_normal((k, m)).astype(np.float32)
        for x in (a, b):
            x[rng.random(x.shape) < 0.05] = special
            x[rng.random(x.shape) < 0.2] = 0.0
        got = memsafe_jit(_products, CANDIDATE)(a, b)
        want = memsafe_jit(_products)(a, b)
        for g, w in zip(got, want):
            g, w = np.asarray(g), np.asarray(w)
            for kind in (np.isnan, np.isposinf, np.isneginf):
                np.testing.assert_array_equal(kind(g), kind(w))
            finite = np.isfinite(w)
            np.testing.assert_allclose(g[finite], w[finite], rtol=1e-4, atol=1e-4)


def _footprint(total: int) -> Footprint:
    return Footprint(arguments=0, outputs=0, temps=total, aliases=0)


class _Timed:
    """An executable that takes ``seconds`` and says who ran."""

    def __init__(self, name: str, seconds: float) -> None:
        self.name, self.seconds, self.calls = name, seconds, 0

    def __call__(self, *args):
        self.calls += 1
        time.sleep(self.seconds)
        return self.name


def _trial(verified: _Timed, candidate: _Timed | None, footprint: int = 10, limit: int = 100):
    plan = Plan(memory_limit=limit)

    def compile_candidate(options):
        assert options == CANDIDATE
        return None if candidate is None else (candidate, _footprint(footprint))

    return tuning.Trial(verified, compile_candidate, plan, "f"), plan


@pytest.mark.parametrize(
    "verified_s, candidate_s, kept", [(0.05, 0.01, "candidate"), (0.01, 0.05, "verified")]
)
def test_the_trial_keeps_the_faster_executable(verified_s, candidate_s, kept):
    verified, candidate = _Timed("verified", verified_s), _Timed("candidate", candidate_s)
    trial, plan = _trial(verified, candidate)
    ran = [trial.run(()) for _ in range(len(tuning.SCHEDULE))]
    assert ran == [role for role, _ in tuning.SCHEDULE]
    assert trial.settled and trial.chosen.name == kept
    assert [trial.run(()) for _ in range(3)] == [kept] * 3
    assert f"runs with {'YNNPACK off' if kept == 'verified' else CANDIDATE[tuning.YNN_OPTION]}" in (
        plan.tuning
    )
    if kept == "candidate":
        assert plan.after.total == 10


@pytest.mark.parametrize("candidate, footprint", [(None, 10), (_Timed("candidate", 0.0), 101)])
def test_a_candidate_that_does_not_compile_or_fit_is_not_run(candidate, footprint):
    verified = _Timed("verified", 0.0)
    trial, plan = _trial(verified, candidate, footprint=footprint, limit=100)
    assert [trial.run(()) for _ in range(8)] == ["verified"] * 8
    assert trial.settled and "not used" in plan.tuning
    assert candidate is None or candidate.calls == 0


def _chain(a, b):
    return jnp.tanh(a @ b) @ b.T


def test_a_tuned_program_settles_within_the_limit_with_jax_jits_answers(monkeypatch):
    monkeypatch.setattr(policy, "TUNING", dataclasses.replace(policy.TUNING, above_flops=0))
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    a, b = jax.random.normal(k1, (256, 128)), jax.random.normal(k2, (128, 512))
    f = memsafe.jit(_chain, memory_limit="4MiB")
    for _ in range(len(tuning.SCHEDULE) + 1):
        assert_like_jit(f(a, b), _chain, a, b)
    plan = f.plan(a, b)
    assert "runs with" in plan.tuning and plan.after.total <= f.memory_limit


def test_small_programs_programs_without_products_and_user_options_are_not_tuned(monkeypatch):
    a = jnp.ones((64, 64))
    f = memsafe.jit(_chain, memory_limit="64MiB")
    for _ in range(len(tuning.SCHEDULE)):
        f(a, a)
    assert f.plan(a, a).tuning == ""  # 1 MFLOP: below policy.TUNING.above_flops
    monkeypatch.setattr(policy, "TUNING", dataclasses.replace(policy.TUNING, above_flops=0))
    h = memsafe.jit(lambda a: jnp.sum(jnp.exp(a), 0), memory_limit="64MiB")
    for _ in range(len(tuning.SCHEDULE)):
        h(a)
    assert h.plan(a).tuning == ""  # no product: the candidate would change nothing
    mine = {tuning.YNN_OPTION: ""}
    g = memsafe.jit(_chain, memory_limit="64MiB", compiler_options=mine)
    for _ in range(len(tuning.SCHEDULE)):
        g(a, a)
    assert g.plan(a, a).tuning == ""


def _sgd_step(w, x):
    loss = lambda w: jnp.mean(jnp.tanh(x @ w) ** 2)
    return w - 0.1 * jax.grad(loss)(w)


def test_a_donated_step_runs_through_the_trial(monkeypatch):
    """Each call donates the parameters the last call returned; the trial's executables (the
    candidate compiled on call 3) take them in turn."""
    monkeypatch.setattr(policy, "TUNING", dataclasses.replace(policy.TUNING, above_flops=0))
    k1, k2 = jax.random.split(jax.random.PRNGKey(1))
    w0, x = jax.random.normal(k1, (64, 32)), jax.random.normal(k2, (512, 64))
    step = memsafe.jit(_sgd_step, memory_limit="8MiB", donate_argnums=0)
    reference = memsafe_jit(_sgd_step)
    w, want = jnp.array(w0), w0
    for _ in range(len(tuning.SCHEDULE) + 2):
        w, want = step(w, x), reference(want, x)
    np.testing.assert_allclose(np.asarray(w), np.asarray(want), rtol=1e-5, atol=1e-6)
    assert "runs with" in step.plan(w, x).tuning
