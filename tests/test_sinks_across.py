"""Reducers combine per-device partials inside ``shard_map`` as they combine chunks: the answer
of one device, ties and NaN included (run in a subprocess with 4 host devices)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import jax, jax.numpy as jnp, numpy as np
    from jax import lax
    from jax.sharding import Mesh, PartitionSpec as P
    from memsafe.split import sinks
    from memsafe.split.strategies.sharded import devices

    mesh = Mesh(np.array(jax.devices()[:4]), ("d",))
    rng = np.random.default_rng(0)
    x = rng.integers(0, 5, (6, 64)).astype(np.float32)  # many ties
    x[2, 40] = np.nan
    x = jnp.asarray(x)

    def across(prim, reducer, **params):
        eqn = jax.make_jaxpr(lambda a: prim(a, **params))(x[:, :16]).eqns[0]

        def body(chunk):
            start = lax.axis_index("d") * chunk.shape[1]
            part = reducer.partial(eqn, [chunk], 1, start, chunk.shape[1])
            return tuple(reducer.finish(devices.combine_partials(reducer, eqn, part, "d")))

        f = jax.shard_map(body, mesh=mesh, in_specs=P(None, "d"), out_specs=P(), check_vma=False)
        return f(x)

    got = across(lambda a, axes: lax.argmax(a, axes[0], jnp.int32), sinks.ARGMAX, axes=(1,))
    np.testing.assert_array_equal(got[0], jnp.argmax(x, 1))
    got = across(lax.top_k, sinks.TOP_K, k=5)
    want = lax.top_k(x, 5)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    got = across(lambda a, axes: jnp.sum(a, axis=axes), sinks.SUM, axes=(1,))
    np.testing.assert_allclose(got[0], jnp.sum(x, 1), rtol=1e-6)
    got = across(lambda a, axes: jnp.max(a, axis=axes), sinks.MAX, axes=(1,))
    np.testing.assert_array_equal(got[0], jnp.max(x, 1))
    got = across(lambda a, axes: jnp.min(a, axis=axes), sinks.MIN, axes=(1,))
    np.testing.assert_array_equal(got[0], jnp.min(x, 1))
    print("ok")
    """
)


def test_reducers_combine_partials_across_devices():
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().endswith("ok")


def test_sums_combine_by_psum_and_the_others_in_device_order():
    """The devices decide, not the reducers: a monoid whose fold adds (sums, contractions, a
    kernel gradient's taps) combines every device's partial at once by ``psum``, whose cost
    memsafe.split.strategies.sharded.mesh counts as the result and one reduced copy; max and min
    (``pmax`` and ``pmin`` drop NaN on the CPU), products and every other reducer are gathered and
    folded in device order."""
    from jax import lax

    from memsafe.split import sinks
    from memsafe.split.prims.conv import TAPS
    from memsafe.split.strategies.halo.rules import HaloTaps
    from memsafe.split.strategies.sharded import devices

    for reducer in (sinks.SUM, sinks.DOT, TAPS, HaloTaps()):
        assert devices.collective(reducer) is lax.psum, reducer
    for reducer in (sinks.MAX, sinks.MIN, sinks.PROD, sinks.ARGMAX, sinks.TOP_K, sinks.XOR):
        assert devices.collective(reducer) is None, reducer
