"""Programs memsafe rewrote into loops that hold bfloat16 or float16 values compile without XLA's
while-loop invariant code motion: on the CPU it hoisted the float32 convert of a whole bfloat16
matmul operand out of the chunk loop, so a bfloat16 attention could not go below a float32 copy
of its keys and values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe import _jax, xla
from memsafe.xla import memsafe_jit
from tests.limits import limit_between


def test_loop_options_turn_the_pass_off_for_narrow_floats_unless_the_user_sets_it():
    narrow = [jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)]
    wide = [jnp.dtype(jnp.float32), jnp.dtype(jnp.int32), None]
    assert xla.loop_options(None, narrow) == xla.LOOP_OPTIONS
    assert xla.loop_options({"a": 1}, [jnp.dtype(jnp.float16)]) == {**xla.LOOP_OPTIONS, "a": 1}
    assert xla.loop_options({"a": 1}, wide) == {"a": 1}
    off = {"xla_disable_hlo_passes": ""}
    assert xla.loop_options(off, narrow) == off


def test_dtypes_are_read_inside_loop_bodies():
    def f(x):
        return jax.lax.scan(lambda c, r: (c + r.astype(jnp.bfloat16).sum(), None), 0.0, x)[0]

    closed = jax.make_jaxpr(f)(jnp.ones((3, 2)))
    assert jnp.dtype(jnp.bfloat16) in set(_jax.dtypes_in(closed.jaxpr))


def _attention(q, k, v):
    return jax.nn.softmax(q @ k.T, axis=-1) @ v


@pytest.mark.parametrize("fraction", [0.1, 0.2])
def test_bfloat16_attention_splits_below_a_float32_copy_of_its_keys(fraction):
    """Refused before (best reached 1.9 MiB: the float32 copies of k and v, 1.28 MB, hoisted
    out of the loop); now its temporaries fit a tenth of jax.jit's."""
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(kq, (32, 8), jnp.bfloat16)
    k = jax.random.normal(kk, (20000, 8), jnp.bfloat16)
    v = jax.random.normal(kv, (20000, 8), jnp.bfloat16)
    limit = limit_between(_attention, (q, k, v), fraction)
    safe = memsafe.jit(_attention, memory_limit=limit)
    got = np.asarray(safe(q, k, v), np.float64)
    plan = safe.plan(q, k, v)
    assert plan.splits and plan.after.total <= limit
    assert plan.after.temps < 2 * 20000 * 8 * 4  # below the float32 copies of k and v
    want = np.asarray(memsafe_jit(_attention)(q, k, v), np.float64)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(a, jnp.float64) for a in (q, k, v)]
        ref = np.asarray(jax.jit(_attention)(*f64))
    # within jax.jit's own error against float64, or one bfloat16 rounding of the result
    bound = max(np.max(np.abs(want - ref)), np.max(np.abs(ref)) * 2.0**-8)
    assert np.max(np.abs(got - ref)) <= 2 * bound


def test_programs_with_prng_keys_have_loop_options_too():
    """Typed PRNG keys have a dtype NumPy does not know; reading a program's dtypes takes them."""

    def f(key, x):
        mask = jax.random.bernoulli(key, 0.5, (x.shape[0], 4000))
        return jnp.sum(jnp.where(mask, x[:, :1] * jnp.ones((1, 4000)), 0.0), 1)

    args = (jax.random.key(0), jnp.ones((2000, 8)))
    closed = jax.make_jaxpr(f)(*args)
    assert xla.loop_options(None, _jax.dtypes_in(closed.jaxpr)) == {}
    limit = limit_between(f, args, 0.25)
    safe = memsafe.jit(f, memory_limit=limit)
    np.testing.assert_array_equal(safe(*args), memsafe_jit(f)(*args))
    assert safe.plan(*args).after.total <= limit
