"""The leading passes that declare ``SCALE_FREE`` run once per search: every attempt starts from
their program and carries their records (issue 42: no repeated work between attempts)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from memsafe import _jax, passes
from memsafe.graph import inline_calls
from memsafe.passes import match_replace, split
from memsafe.plan import PlanTime, RuleRecord
from memsafe.search import Search


def _knn(x, y):
    d = jnp.sum((x[:, None] - y[None]) ** 2, -1)  # the naive distance: a rule rewrites it
    return jax.lax.top_k(-d, 3)[1]


def _search(limit: int) -> tuple[Search, int]:
    avals = [jax.ShapeDtypeStruct((256, 16), jnp.float32), jax.ShapeDtypeStruct((4096, 16), "f4")]
    closed, out_tree = _jax.make_closed_jaxpr(_knn, avals)
    fixed = sum(_jax.nbytes_of_aval(v.aval) for v in [*closed.jaxpr.invars, *closed.jaxpr.outvars])
    search = Search(closed, avals, limit, (), "knn", None, 0, out_tree, PlanTime())
    return search, fixed


def test_the_scale_free_passes_run_once_per_search(monkeypatch):
    assert passes.scale_free_lead() >= 1
    assert passes.scale_free_lead((split, match_replace)) == 0
    calls = {"match_replace": 0, "split": 0}

    def counted(name, run):
        def wrapped(closed, ctx):
            calls[name] += 1
            return run(closed, ctx)

        return wrapped

    monkeypatch.setattr(match_replace, "run", counted("match_replace", match_replace.run))
    monkeypatch.setattr(split, "run", counted("split", split.run))
    search, fixed = _search(1 << 20)
    first = search.attempt(0, 1.0, fixed)
    second = search.attempt(1, 0.25, fixed)
    assert calls == {"match_replace": 1, "split": 2}
    for tried in (first, second):
        rules = [r for r in tried.plan.records if isinstance(r, RuleRecord)]
        assert [r.rule for r in rules] == ["pairwise_sqdist"]
        assert tried.plan.splits  # split ran on the rewritten program
    assert second.plan.splits[0].chunk < first.plan.splits[0].chunk


def test_each_attempt_is_the_program_a_full_pipeline_makes():
    """The shared start changes nothing: an attempt's program equals the one every pass run in
    turn makes at the same scale."""
    from memsafe.context import PassContext
    from memsafe.pipeline import run_passes
    from memsafe.plan import Plan

    search, fixed = _search(1 << 20)
    search.attempt(0, 1.0, fixed)  # the start is kept
    tried = search.attempt(1, 0.5, fixed)
    ctx = PassContext(1 << 20, fixed, Plan(memory_limit=1 << 20), chunk_scale=0.5)
    whole = run_passes(passes.named_passes(), inline_calls(search.flat), ctx, "knn")
    assert str(whole.jaxpr) == str(tried.program.jaxpr)
    assert ctx.plan.records == tried.plan.records
