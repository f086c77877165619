"""Sums over a split axis of floats narrower than 32 bits accumulate in float32 and round once
(``memsafe.split.sinks.Reducer.lift``): in bfloat16 every chunk would round the running sum
again, and the error grows with the chunk count (deep fuzz seed 3960, tests/fuzz/FOUND.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import memsafe
from memsafe.split import sinks
from tests.agree import assert_like_jit

BF16 = jnp.bfloat16


def _kernel_matvec(a, b, v):
    return jnp.exp(-jnp.square(a[:, None] - b[None, :])) @ v


def _broadcast_gradient(a, b):
    def loss(b):
        return jnp.sum(jnp.exp(-jnp.square(a[:, None] * b[None, :])), dtype=jnp.float32)

    return jax.grad(loss)(b)  # a bfloat16 reduce_sum over the rows (jax.jit's error: 519)


def test_a_bfloat16_contraction_over_hundreds_of_chunks_rounds_once():
    rng = np.random.default_rng(0)
    args = (
        jnp.asarray(rng.standard_normal(128), BF16),
        jnp.asarray(rng.standard_normal(65536), BF16),
        jnp.asarray(rng.random(65536), BF16),
    )
    f = memsafe.jit(_kernel_matvec, memory_limit="300KiB")
    (split,) = f.plan(*args).splits
    assert split.loops > 500  # in bfloat16 its error was 165 x jax.jit's
    got = f(*args)
    assert got.dtype == BF16
    assert_like_jit(got, _kernel_matvec, *args)


def test_a_bfloat16_sum_of_a_broadcast_gradient_over_chunks():
    rng = np.random.default_rng(1)
    args = (
        jnp.asarray(rng.standard_normal(65536), BF16),
        jnp.asarray(rng.standard_normal(64), BF16),
    )
    f = memsafe.jit(_broadcast_gradient, memory_limit="300KiB")
    assert f.plan(*args).splits[0].loops > 100
    assert_like_jit(f(*args), _broadcast_gradient, *args)


def test_which_reducers_keep_a_wider_accumulator():
    eqn = jax.make_jaxpr(lambda a, b: a @ b)(jnp.ones((4, 8), BF16), jnp.ones(8, BF16)).eqns[0]
    assert sinks.DOT.accumulator(BF16) == np.float32
    assert sinks.SUM.accumulator(jnp.float16) == np.float32
    assert sinks.SCATTER_INTO["scatter-add"].accumulator(BF16) == np.float32
    for exact in (sinks.MAX, sinks.PICK, sinks.SCATTER_INTO["scatter-max"]):
        assert exact.accumulator(BF16) == BF16  # no rounding to build up
    assert sinks.DOT.accumulator(jnp.float32) == np.float32
    assert sinks.SUM.accumulator(jnp.int8) == np.int8
    (part,) = sinks.DOT.lift(
        sinks.DOT.partial(eqn, [jnp.ones((4, 8), BF16), jnp.ones(8, BF16)], 1, 0, 8)
    )
    assert part.dtype == np.float32  # the chunk's product straight into float32
    (done,) = sinks.finished(sinks.DOT, eqn, (lax.add(part, part),))
    assert done.dtype == BF16 and float(done[0]) == 16.0
    assert sinks.DOT.running_bytes(eqn.outvars[0].aval) == 4 * 4
