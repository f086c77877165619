"""The extension points of docs/contributing.md ("Add a primitive", "Add a sink", "Add a pass",
"Add a strategy" and its span), used as a library outside memsafe would use them: toy
primitives defined with JAX's public API (``jax.extend.core.Primitive``), described and registered
through those points only, each planned under a limit that forces a split through it, with
jax.jit's answers.

Each fixture removes what it registered, so no other test sees the toys. Every line of code the
guide shows is one of this module's (the last test).
"""

from __future__ import annotations

import re
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.extend.core import Literal, Primitive
from jax.interpreters import mlir

import memsafe
from memsafe import passes
from memsafe.graph import retrace
from memsafe.plan import PassRecord
from memsafe.primitives import Facts, Kind, declare
from memsafe.split import planner
from memsafe.split.registry import SPLIT_RULES, Mapping, NoRule, positional, split_rule
from memsafe.split.sinks import Reducer, Sink
from memsafe.split.strategies.halo import Extended
from memsafe.split.strategies.staged import StagedSplit
from memsafe.xla import Footprint, memsafe_jit
from tests.agree import assert_like_jit

N, M, D = 256, 2048, 8


def _primitive(name, impl, abstract):
    """A primitive of JAX's public API: evaluated by ``impl``, lowered through it."""
    p = Primitive(name)
    p.def_impl(impl)
    p.def_abstract_eval(abstract)
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
    return p


def _same(x, **params):
    return x


# A toy elementwise primitive.
softplus_p = _primitive("toy_softplus", lambda x: jnp.logaddexp(x, 0.0), _same)
# A toy layout primitive the axis passes through but along its last axis.
flip_p = _primitive("toy_flip", lambda x: jnp.flip(x, -1), _same)
# A toy reduction over ``axes`` of a monoid memsafe knows (sums).
sumsq_p = _primitive(
    "toy_sumsq",
    lambda x, *, axes: jnp.sum(x * x, axis=axes),
    lambda x, *, axes: x.update(shape=tuple(n for d, n in enumerate(x.shape) if d not in axes)),
)
# A toy reduction memsafe knows no monoid for: the index of the largest |x| along the last axis,
# the first on ties, the first NaN where there is one (as ``jnp.argmax``).
argmaxabs_p = _primitive(
    "toy_argmaxabs",
    lambda x: jnp.argmax(jnp.abs(x), axis=-1).astype(jnp.int32),
    lambda x: x.update(shape=x.shape[:-1], dtype=np.dtype(np.int32), weak_type=False),
)


def _data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((N, D), dtype=np.float32)
    y = rng.standard_normal((M, D), dtype=np.float32)
    return jnp.asarray(x), jnp.asarray(y)


def _scores(x, y):
    return x @ y.T


def _planned(fun, *args):
    """``fun`` under memsafe.jit with a limit of its arguments, outputs and a quarter of
    jax.jit's temporaries: its plan, after checking the answers against jax.jit's."""
    plain = Footprint.from_compiled(memsafe_jit(fun).lower(*args).compile())
    fixed = plain.arguments + plain.outputs
    limit = fixed + (plain.total - fixed) // 4
    f = memsafe.jit(fun, memory_limit=limit)
    got = f(*args)
    plan = f.plan(*args)
    assert plan.splits and plan.after.total <= limit, plan
    assert_like_jit(got, fun, *args)
    return plan


def _ops(plan):
    return {op for s in plan.splits for op in (*s.ops, *s.sinks)}


# -- an elementwise primitive: one call ------------------------------------------------------


@pytest.fixture
def softplus():
    declare("toy_softplus", Facts(Kind.ELEMENTWISE, fusible=True))
    yield softplus_p
    declare("toy_softplus", None)


def test_an_elementwise_primitive_is_one_declaration(softplus):
    plan = _planned(lambda x, y: softplus.bind(_scores(x, y)).sum(1), *_data())
    assert "toy_softplus" in _ops(plan), plan


# -- a reduction over axes of a known monoid: one call ---------------------------------------


@pytest.fixture
def sumsq():
    declare("toy_sumsq", Facts(Kind.REDUCTION, monoid="sum"))
    yield sumsq_p
    declare("toy_sumsq", None)


def test_a_reduction_of_a_known_monoid_is_one_declaration(sumsq):
    plan = _planned(lambda x, y: sumsq.bind(jnp.sin(_scores(x, y)), axes=(1,)), *_data())
    assert "toy_sumsq" in _ops(plan), plan


# -- a primitive the axis passes through: a split rule ---------------------------------------


def _flip_map(eqn, side, axis, ctx):
    """The axis passes at its position, but along the flipped (last) axis."""
    if axis == len(eqn.invars[0].aval.shape) - 1:
        raise NoRule("toy_flip reverses the split axis")
    return Mapping(ins=(axis,), outs=(axis,))


@pytest.fixture
def flip():
    declare("toy_flip", Facts(Kind.LAYOUT, fusible=True, cheap=True))
    split_rule("toy_flip")(_flip_map)
    yield flip_p
    del SPLIT_RULES["toy_flip"]
    declare("toy_flip", None)


def test_a_pass_through_primitive_is_a_split_rule(flip):
    x, y = _data()
    t = jnp.arange(M, dtype=jnp.float32) / M
    plan = _planned(lambda x, y, t: (jnp.exp(flip.bind(_scores(x, y))) * t).sum(1), x, y, t)
    assert "toy_flip" in _ops(plan), plan


# -- a sink: a reducer ------------------------------------------------------------------------


class ArgMaxAbs(Reducer):
    """``toy_argmaxabs`` over chunks: each chunk's best |x| and its global index; a later chunk
    wins only with a strictly larger value (ties keep the earlier), or with the first NaN."""

    name = "argmaxabs"  # shown in plans

    def partial(self, eqn, invals, axis, start, size):
        idx = eqn.primitive.bind(*invals, **eqn.params)
        best = jnp.take_along_axis(jnp.abs(invals[0]), idx[..., None], axis=-1)[..., 0]
        return best, idx + lax.convert_element_type(start, idx.dtype)

    def fold(self, eqn, acc, new):
        (best, at), (value, index) = acc, new
        take = (value > best) | (jnp.isnan(value) & ~jnp.isnan(best))
        return jnp.where(take, value, best), jnp.where(take, index, at)

    def finish(self, acc):
        return [acc[1]]


ARGMAXABS = ArgMaxAbs()


def _argmaxabs_map(eqn, side, axis, ctx):
    """A sink along its last axis; other axes pass."""
    if side[0] == "in" and axis == len(eqn.invars[0].aval.shape) - 1:
        return Sink(ARGMAXABS, ins=(axis,))
    return Mapping(ins=(axis,), outs=(axis,))


@pytest.fixture
def argmaxabs():
    declare("toy_argmaxabs", Facts(Kind.OTHER, decides=True))
    split_rule("toy_argmaxabs")(_argmaxabs_map)
    yield argmaxabs_p
    del SPLIT_RULES["toy_argmaxabs"]
    declare("toy_argmaxabs", None)


def test_a_sink_is_a_reducer_its_rule_returns(argmaxabs):
    x, y = _data()
    x = x[:8]  # few rows: the split runs along the reduced axis
    holes = np.zeros((8, M), bool)
    holes[1, 1500] = holes[3, 700] = holes[3, 1800] = True  # NaN in later chunks

    def fun(x, y, holes):
        s = jnp.round(_scores(x, y))  # ties
        return argmaxabs.bind(jnp.where(holes, jnp.nan, s))

    plan = _planned(fun, x, y, jnp.asarray(holes))
    assert "argmaxabs" in _ops(plan), plan
    # the data has what the reducer must decide as jnp.argmax does: NaN, and ties
    want = np.asarray(jax.jit(fun)(x, y, holes))
    assert want[1] == 1500 and want[3] == 700
    s = np.abs(np.round(np.asarray(x) @ np.asarray(y).T))
    assert (s == s.max(1, keepdims=True)).sum(1).max() > 1


# -- a pass ----------------------------------------------------------------------------------


def _drop_times_one(closed, ctx):
    """``x * 1.0`` becomes ``x``: a pass that rewrites what it finds and records it."""
    dropped = []

    def override(index, eqn, invals):
        if eqn.primitive.name != "mul":
            return None
        for k, atom in enumerate(eqn.invars):
            other = eqn.invars[1 - k]
            if (
                isinstance(atom, Literal)
                and np.ndim(atom.val) == 0
                and atom.val == 1
                and other.aval.shape == eqn.outvars[0].aval.shape
                and other.aval.dtype == eqn.outvars[0].aval.dtype
            ):
                dropped.append(index)
                return [invals[1 - k]]
        return None

    new = retrace(closed, override)
    if dropped:
        ctx.record(PassRecord("drop_times_one", f"dropped {len(dropped)} multiplications by 1"))
    return new


DROP_TIMES_ONE = types.SimpleNamespace(__name__="drop_times_one", run=_drop_times_one)


@pytest.fixture
def drop_times_one(monkeypatch):
    monkeypatch.setattr(passes, "PIPELINE", passes.PIPELINE)  # restored after the test
    passes.PIPELINE = passes.inserted(DROP_TIMES_ONE, before="split")


def test_a_pass_joins_the_pipeline(drop_times_one):
    plan = _planned(lambda x, y: jnp.exp(_scores(x, y) * 1.0).sum(1), *_data())
    assert [r.pass_name for r in plan.passes].count("drop_times_one") == 1, plan
    assert "mul" not in _ops(plan), plan


# -- a strategy -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Labelled(StagedSplit):
    label: ClassVar[str | None] = "toy_strategy"  # shown in the plan's sinks


def _toy_strategy(graph, region):
    return Labelled(region) if region.n_stages == 1 else None


@pytest.fixture
def toy_strategy(monkeypatch):
    monkeypatch.setattr(planner, "STRATEGIES", list(planner.STRATEGIES))  # restored after
    planner.add_strategy(_toy_strategy)


def test_a_strategy_plans_the_regions_it_applies_to(toy_strategy):
    plan = _planned(lambda x, y: jnp.exp(_scores(x, y)).sum(1), *_data())
    assert "toy_strategy" in _ops(plan), plan


# -- a span -----------------------------------------------------------------------------------


class Padded:
    mixed_lengths = False

    def applies(self, graph):
        return True

    def context(self, ctx):
        return ctx

    def admit(self, eqn, mapping):
        if not positional(eqn, mapping):
            raise NoRule("a position reads others: not on padded chunks")

    def span(self, graph, maps, axis_of, surviving, size):
        return size, Extended(extend=1, scale={})


@pytest.fixture
def padded(monkeypatch):
    monkeypatch.setattr(planner, "SPANS", planner.SPANS)  # restored after the test
    planner.SPANS = [Padded(), *planner.SPANS]


def test_a_span_covers_what_its_spanning_says(padded):
    """Every chunk read, computed and reduced one position wider on each side: jax.jit's
    answers, the sum and the values written along the axis from the chunks' own positions."""
    plan = _planned(lambda x, y: jnp.tanh(_scores(x, y)).sum(1), *_data())
    assert [s.extend for s in plan.splits] == [1], plan


# -- the guide ------------------------------------------------------------------------------


def test_the_contributing_guide_shows_what_this_module_does():
    guide = (Path(__file__).resolve().parent.parent / "docs" / "contributing.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, flags=re.S)
    assert len(blocks) >= 5
    own = {line.strip() for line in Path(__file__).read_text().splitlines()}
    shown = [line.strip() for block in blocks for line in block.splitlines()]
    assert [line for line in shown if line and "..." not in line and line not in own] == []
