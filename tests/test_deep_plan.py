"""plan() states what a staged split costs: its stages and the flops later stages recompute
(memsafe.split.strategies.recompute), priced by memsafe.flops."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from memsafe.flops import eqn_flops, jaxpr_flops
from memsafe.graph import Graph, inline_calls
from memsafe.plan import Plan, SplitRecord
from memsafe.split.planner import strategy
from memsafe.split.region import grow
from memsafe.split.strategies import recompute
from memsafe.split.strategies.staged import StagedSplit


def _eqns(fun, *args):
    return inline_calls(jax.make_jaxpr(fun)(*args)).jaxpr.eqns


def test_flops_of_contractions_elementwise_layout_and_loops():
    a, b = jnp.ones((6, 5)), jnp.ones((5, 7))
    (dot,) = _eqns(jnp.matmul, a, b)
    assert eqn_flops(dot) == 2 * 6 * 5 * 7
    tanh, total, reshape = _eqns(lambda x: (jnp.tanh(x), x.sum(), x.reshape(-1)), a)
    assert (eqn_flops(tanh), eqn_flops(total), eqn_flops(reshape)) == (30, 30, 0)
    x, w = jnp.ones((2, 9, 8, 3)), jnp.ones((3, 3, 3, 4))  # NHWC, HWIO
    (conv,) = _eqns(lambda x, w: lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")), x, w)  # fmt: skip
    assert eqn_flops(conv) == 2 * (2 * 9 * 8 * 4) * (3 * 3 * 3)

    def loop(a, b):
        return lax.scan(lambda c, _: (c + (a @ b).sum(), None), 0.0, None, length=10)[0]

    (scan,) = [e for e in _eqns(loop, a, b) if e.primitive.name == "scan"]
    assert eqn_flops(scan) == 10 * jaxpr_flops(scan.params["jaxpr"].jaxpr.eqns)
    assert eqn_flops(scan) >= 10 * 2 * 6 * 5 * 7


def _centred(x, w):
    """Batch statistics: the mean over the batch must be known before what reads it."""
    h = x @ w
    return jnp.sum(jnp.tanh(h - h.mean(0)))


def test_a_staged_split_states_its_recompute_cost():
    """Split along the batch, the second stage re-evaluates the product the first stage's mean
    summed: 2 n d k flops; an online softmax recomputes nothing."""
    n, d, k = 64, 8, 16
    x, w = jnp.ones((n, d)), jnp.ones((d, k))
    closed = inline_calls(jax.make_jaxpr(_centred)(x, w))
    graph = Graph(closed)
    seed = next(e.outvars[0] for e in graph.eqns if e.primitive.name == "dot_general")
    split = strategy(graph, grow(graph, seed, 0, 1, 10**9))
    assert isinstance(split, StagedSplit)
    want = {"stages": 2, "recompute_flops": 2 * n * d * k, "extend": 0}
    assert recompute.cost(graph, split) == want

    def attention(q, kv):
        return jax.nn.softmax(q @ kv.T, -1) @ kv

    closed = inline_calls(jax.make_jaxpr(attention)(x, x))
    graph = Graph(closed)
    seed = next(e.outvars[0] for e in graph.eqns if e.primitive.name == "dot_general")
    online = strategy(graph, grow(graph, seed, 1, 1, 10**9))
    assert recompute.cost(graph, online) == {"stages": 1, "recompute_flops": 0, "extend": 0}


def test_plan_text_names_stages_and_recompute_flops():
    rec = SplitRecord("f32[64,16]", 4096, 0, 64, 16, 8, ("dot_general",), ("sum",), **{
        "stages": 2, "recompute_flops": 16384})  # fmt: skip
    assert "into 8 chunks of 16; 2 stages recomputing ~1.6e+04 flops" in rec.describe()
    plan = Plan(memory_limit=1, records=[rec], backward=Plan(memory_limit=1, records=[rec]))
    assert plan.recompute_flops == 2 * 16384
    assert "recompute cost: ~3.3e+04 flops (staged splits, halos, remat)" in str(plan)
    single = SplitRecord("f32[64,16]", 4096, 0, 64, 16, 4, ("exp",), ("sum",))
    assert "stages" not in single.describe() and "recompute cost" not in str(
        Plan(1, records=[single])
    )


def test_values_repeated_per_layer_are_counted():
    value = " + ".join(["f32[4,64] (dot_general at m.py:3)"] * 3 + ["f32[4,8] (exp at m.py:4)"])
    rec = SplitRecord(value, 4096, 0, 4, 1, 4, ("dot_general",), ("sum",))
    text = rec.describe()
    assert text.startswith("split 3 x f32[4,64] (dot_general at m.py:3) + f32[4,8] (exp at m.py:4)")


def test_a_training_step_is_not_split_a_position_at_a_time_where_it_fits_without():
    """The GPT step of benchmarks/train_step_model.py (batch 1, L = 512) under arguments +
    outputs + half of jax.jit's temporaries fits with its blocks' values in chunks of many rows.
    The planner's retry measuring held values against the whole room (best_split) once also
    split the attention scores and the MLP's backward there in chunks of one row (1,024 loops,
    its step 6x slower), splits the size model expects over the budget even then. They are taken
    only in attempts after one over the limit (-m slow: about a minute)."""
    import memsafe
    from benchmarks.paired import _program

    fun, args, limit = _program("train_step")
    plan = memsafe.jit(fun, memory_limit=limit).plan(*args)
    assert plan.after.total <= limit
    assert max(s.loops for s in plan.splits) < 512, [s.describe() for s in plan.splits]
