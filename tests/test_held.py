"""memsafe.graph.held: the bytes every compile of a program holds at once, a lower bound on
XLA's footprint (the search skips compiling an original program over the limit by it alone)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from memsafe import _jax
from memsafe.graph import inline_calls
from memsafe.graph.held import held_bytes
from memsafe.xla import contractions_stored, memsafe_jit
from tests import deep_models as dm
from tests.agree import assert_like_jit

MiB = 2**20


def _flat(fun, *args):
    leaves, tree = jax.tree_util.tree_flatten(args)

    def flat(*xs):
        return jax.tree_util.tree_leaves(fun(*jax.tree_util.tree_unflatten(tree, xs)))

    return flat, [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves]


def _both(fun, *args) -> tuple[int, int, int]:
    """(held bytes, XLA's footprint with memsafe's options, arguments + outputs)."""
    flat, avals = _flat(fun, *args)
    closed, _ = _jax.make_closed_jaxpr(flat, avals)
    m = memsafe_jit(flat, None).lower(*avals).compile().memory_analysis()
    fixed = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    return held_bytes(inline_calls(closed)), fixed + m.temp_size_in_bytes, fixed


def _mlp_step():
    loss, params, batch = dm.mlp(batch=2048, width=256, layers=6)
    step, state = dm.adam_step(loss, params)
    return step, (params, state, *batch)


def _residual(ws, x):
    for w in ws:
        x = x + jnp.tanh(x @ w)
    return jnp.sum(x**2)


def _checkpointed(ws, x):
    for w in ws:
        x = jax.checkpoint(lambda x, w: jnp.tanh(x @ w) * 2.0 + x)(x, w)
    return jnp.mean(x)


def _attention(q, k, v):
    s = jnp.einsum("bqd,bkd->bqk", q, k) / 8.0
    n = s.shape[-1]
    mask = jnp.arange(n)[:, None] >= jnp.arange(n)[None, :]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.sum(jnp.einsum("bqk,bkd->bqd", p, v) ** 2)


def _twice(x, w):
    a = x @ w
    b = x @ w  # the same contraction: XLA may compute it once
    return jnp.tanh(a) @ jnp.tanh(b).T


def _returned(x, w):
    y = x @ w
    return y.reshape(-1), jnp.tanh(y) + 1.0, (jnp.ones_like(x) @ w).sum()


def _key(n):
    return jax.random.PRNGKey(n)


def _ws(n, width, layers):
    return [
        jax.random.normal(k, (width, width)) / width**0.5 for k in jax.random.split(_key(n), layers)
    ]


CASES = {
    "mlp_adam": _mlp_step,
    "residual_grad": lambda: (jax.grad(_residual), (_ws(1, 256, 5), jnp.ones((1024, 256)))),
    "checkpointed_grad": lambda: (
        jax.grad(_checkpointed),
        (_ws(2, 256, 4), jnp.ones((1024, 256))),
    ),
    "attention_grad": lambda: (
        jax.grad(_attention, argnums=(0, 1, 2)),
        tuple(jax.random.normal(k, (4, 512, 64)) for k in jax.random.split(_key(3), 3)),
    ),
    "same_dot_twice": lambda: (_twice, (jnp.ones((512, 256)), jnp.ones((256, 256)))),
    "dot_returned": lambda: (_returned, (jnp.ones((1024, 256)), jnp.ones((256, 512)))),
    "flax_small": lambda: _flax_step(),
}


def _flax_step():
    loss, params, batch = dm.flax_model(dm.Shape(blocks=2, batch=2, length=256, width=64))
    step, state = dm.adam_step(loss, params)
    return step, (params, state, *batch)


pytestmark = pytest.mark.skipif(
    not contractions_stored(), reason="the bound counts on the CPU's stored contractions"
)


@pytest.mark.parametrize("case", sorted(CASES))
def test_held_is_a_lower_bound(case):
    fun, args = CASES[case]()
    held, footprint, _ = _both(fun, *args)
    assert held <= footprint, (held / MiB, footprint / MiB)


def test_held_counts_the_saved_contractions():
    """An MLP's gradient keeps each layer's result for the backward pass: the bound counts them
    all (6 layers of 2 MiB), not only the arguments and outputs."""
    fun, args = _mlp_step()
    held, footprint, fixed = _both(fun, *args)
    assert held >= fixed + 6 * 2 * MiB
    assert held <= footprint


def test_search_skips_the_original_it_knows_is_over():
    """Under a limit below the bound, the original is not compiled while planning (its
    footprint is measured when the plan's ``before`` is read, and is over the bound); the plan
    fits and gives jax.jit's answers."""
    import memsafe

    fun, args = _mlp_step()
    held, _, fixed = _both(fun, *args)
    limit = (fixed + held) // 2
    safe = memsafe.jit(fun, memory_limit=limit)
    out = safe(*args)
    plan = safe.plan(*args)
    assert plan.time.held == held and plan.measure_before is not None
    assert not any("original" in what for what, _ in plan.time.compiles)
    assert plan.after.total <= limit
    assert plan.before.total >= held and plan.measure_before is None
    assert_like_jit(out, fun, *args)


def test_held_leaves_out_products_xla_may_fold():
    """A product of a broadcast (seen through a reshape and a conversion) is not counted: XLA
    may rewrite it into a reduction; nor one under ``min_extent`` (a matrix-vector product)."""

    def of_broadcast(v, w):
        x = jnp.broadcast_to(v, (1024, 256)).reshape(1024, 256).astype(jnp.float32)
        return jnp.sum(jnp.tanh(x @ w))

    def matvec(x, w):
        return jnp.sum(jnp.tanh(w @ x) * 2.0)

    for fun, args in (
        (of_broadcast, (jnp.ones((256,), jnp.float16), jnp.ones((256, 256)))),
        (matvec, (jnp.ones((256,)), jnp.ones((4096, 256)))),
    ):
        flat, avals = _flat(fun, *args)
        closed, _ = _jax.make_closed_jaxpr(flat, avals)
        fixed = sum(_jax.nbytes_of_aval(v.aval) for v in closed.jaxpr.invars) + 4
        assert held_bytes(inline_calls(closed)) == fixed, fun.__name__
