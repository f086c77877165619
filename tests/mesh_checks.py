"""Checks of memsafe.jit on a mesh of 8 host devices, run in a subprocess by tests/test_mesh.py
(JAX's device count is fixed when it starts): ``python tests/mesh_checks.py NAME ...``."""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("MEMSAFE_STRICT", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import memsafe
from memsafe.xla import memsafe_jit

MiB = 2**20
K = 5


def mesh8() -> Mesh:
    return Mesh(np.array(jax.devices()[:8]), ("d",))


def knn(x, y):
    d = jnp.sum((x[:, None] - y[None]) ** 2, -1)
    return lax.top_k(-d, K)


def knn_reference(x, y, rows: int = 4096):
    """Neighbours from float64 distances, lowest index first among equal distances (the
    differences made ``rows`` database points at a time)."""
    x64 = np.asarray(x, np.float64)
    d = np.empty((x64.shape[0], len(y)))
    for start in range(0, len(y), rows):
        part = np.asarray(y[start : start + rows], np.float64)
        d[:, start : start + rows] = ((x64[:, None] - part[None]) ** 2).sum(-1)
    return np.argsort(d, axis=1, kind="stable")[:, :K]


def footprint(f, *args) -> int:
    """Every device's compiled footprint (memory_analysis of the SPMD program is per device)."""
    return f.plan(*args).after.total


def knn_data(n: int, m: int, dim: int = 64, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, dim)).astype(np.float32)
    y = rng.standard_normal((m, dim)).astype(np.float32)
    return x, y


def check_knn(m: int = 65536, limit: int = 6 * MiB) -> None:
    """A database larger than the per-device limit: one device refuses, 8 devices fit."""
    x, y = knn_data(64, m)
    assert y.nbytes > limit
    try:
        memsafe.jit(knn, memory_limit=limit)(x, y)
    except memsafe.MemoryLimitError:
        pass
    else:
        raise AssertionError("one device should not fit")
    f = memsafe.jit(knn, memory_limit=limit, mesh=mesh8())
    start = time.perf_counter()
    _, idx = jax.block_until_ready(f(x, y))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(f(x, y))
    again = time.perf_counter() - start
    np.testing.assert_array_equal(np.asarray(idx), knn_reference(x, y))
    got = footprint(f, x, y)
    assert got <= limit, got
    try:  # even an eighth of the database exceeds 1 MiB
        memsafe.jit(knn, memory_limit=MiB, mesh=mesh8())(x, y)
    except memsafe.MemoryLimitError as err:
        assert "even sharded over the 8 devices" in str(err), err
    else:
        raise AssertionError("the per-device share should not fit")
    plan = str(f.plan(x, y))
    assert f"sharded over mesh axes (d): 8 devices, {m // 8} each" in plan, plan
    assert "top_k in tiles" in plan, plan
    print(f"knn m={m}: footprint per device {got / MiB:.2f} MiB <= {limit / MiB:.0f} MiB; "
          f"first call (planned, compiled) {first:.1f} s, then {again:.2f} s")  # fmt: skip


def check_knn_uneven() -> None:
    """8 does not divide the database: ties and NaN across the devices' boundaries and in the
    last positions, equal to jax.jit."""
    x, y = knn_data(16, 8 * 1000 + 5, 8, seed=1)
    y[3000:3010] = y[10]  # exact ties across a device boundary (1000 per device)
    y[1994:1998] = y[10]  # and in a device's last positions after its whole blocks of 32
    y[-3:] = y[5]  # ties in the remainder
    y[4500, 2] = np.nan
    x[3, 1] = np.nan
    f = memsafe.jit(knn, memory_limit=160 * 1024, mesh=mesh8())
    got = f(x, y)
    want = memsafe_jit(knn)(x, y)
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    # the squared-distance rewrite rounds differently (docs/accuracy.md); the order is exact
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    assert f.plan(x, y).splits[0].devices == 8
    assert "top_k in tiles" in str(f.plan(x, y))  # each device's share, then merged
    assert footprint(f, x, y) <= 160 * 1024
    argmin = memsafe.jit(lambda x, y: jnp.argmin(jnp.sum((x[:, None] - y[None]) ** 2, -1), 1),
                         memory_limit=160 * 1024, mesh=mesh8())  # fmt: skip
    want = memsafe_jit(lambda x, y: jnp.argmin(jnp.sum((x[:, None] - y[None]) ** 2, -1), 1))
    np.testing.assert_array_equal(np.asarray(argmin(x, y)), np.asarray(want(x, y)))
    print("uneven: equal to jax.jit")


def check_placements() -> None:
    """Inputs committed to one device or sharded along another axis give the same answer."""
    x, y = knn_data(32, 16384, 16, seed=2)
    mesh = mesh8()
    f = memsafe.jit(knn, memory_limit=512 * 1024, mesh=mesh)
    want = f(x, y)
    one = jax.device_put(y, jax.devices()[3])
    cols = jax.device_put(y, NamedSharding(mesh, P(None, "d")))
    for yy in (one, cols):
        got = f(jax.device_put(x, jax.devices()[1]), yy)
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    carried = memsafe.jit(knn, memory_limit=512 * 1024)  # mesh from the arguments' sharding
    got = carried(x, jax.device_put(y, NamedSharding(mesh, P("d"))))
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    assert carried.plan(x, cols).splits[0].devices == 8
    with jax.set_mesh(mesh):  # the mesh set in the context
        ctx = memsafe.jit(knn, memory_limit=512 * 1024)
        got = ctx(x, y)
        assert ctx.plan(x, y).splits[0].devices == 8
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    print("placements: equal")


def attention(q, k, v):
    s = jnp.einsum("hqd,hkd->hqk", q, k) / np.sqrt(q.shape[-1])
    return jnp.einsum("hqk,hkd->hqd", jax.nn.softmax(s, axis=-1), v)


def check_attention() -> None:
    """Keys sharded: the online softmax merged across devices, forward and gradient."""
    rng = np.random.default_rng(3)
    h, lq, lk, d = 2, 64, 8192, 16
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in
               ((h, lq, d), (h, lk, d), (h, lk, d)))  # fmt: skip
    limit = 2 * MiB
    f = memsafe.jit(attention, memory_limit=limit, mesh=mesh8())
    np.testing.assert_allclose(f(q, k, v), memsafe_jit(attention)(q, k, v), rtol=2e-5, atol=2e-6)
    assert footprint(f, q, k, v) <= limit
    assert "online_softmax" in f.plan(q, k, v).splits[0].sinks

    def loss(fun):
        return lambda q, k, v: jnp.sum(fun(q, k, v) ** 2)

    got = jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)
    want = jax.jit(jax.grad(loss(attention), argnums=(0, 1, 2)))(q, k, v)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    back = f.backward_plan(q, k, v)
    assert back.after.total <= limit, back
    print(f"attention: forward {footprint(f, q, k, v) / MiB:.2f} MiB, "
          f"backward {back.after.total / MiB:.2f} MiB per device")  # fmt: skip


def check_sgpr() -> None:
    """The SGPR bound and its gradient with the data points sharded."""
    from examples import sgpr

    with jax.enable_x64(True):
        x, y, z = sgpr.make_data(20000, 64, 4, 0)
        params = {"variance": jnp.asarray(1.3), "lengthscales": jnp.full(4, 0.7),
                  "noise": jnp.asarray(0.2), "Z": jnp.asarray(z)}  # fmt: skip
        limit = 4 * MiB
        f = memsafe.jit(sgpr.sgpr_elbo, memory_limit=limit, mesh=mesh8())
        want = jax.jit(sgpr.sgpr_elbo)(params, x, y)
        np.testing.assert_allclose(f(params, x, y), want, rtol=1e-10)
        assert footprint(f, params, x, y) <= limit
        assert any(s.devices == 8 for s in f.plan(params, x, y).splits)
        # the parameters differentiated only (x and y unperturbed), as a user trains
        got = jax.grad(f)(params, x, y)
        ref = jax.jit(jax.grad(sgpr.sgpr_elbo))(params, x, y)
        for key in params:
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-7, atol=1e-9)
        back = f.plan(params, x, y).backward
        assert back.after.total <= limit, back
        assert back.splits and all(s.devices == 8 for s in back.splits), back
    print(f"sgpr: bound and gradient equal, backward {back.after.total / MiB:.2f} MiB per device")


def check_mesh_2d() -> None:
    """A 2 x 4 mesh with many queries: the loop runs over the queries on one mesh axis, the
    database it reads whole is split over the other (XLA partitions the loop), equal to the
    float64 neighbours, under a limit the same 8 devices as one axis do not reach; with few
    queries the loop runs over the database on both axes."""
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("q", "d"))
    x, y = knn_data(8192, 16384, 16, seed=4)
    limit = 5 * MiB // 2  # one mesh axis of 8: best 2.8 MiB; this layout: 1.9 MiB
    f = memsafe.jit(knn, memory_limit=limit, mesh=mesh)
    _, idx = f(x, y)
    np.testing.assert_array_equal(np.asarray(idx), knn_reference(x, y))
    split = f.plan(x, y).splits[0]
    assert (split.mesh_axes, split.batch_mesh_axes, split.devices) == (("q",), ("d",), 2), split
    assert "inputs read whole split over mesh axes (d)" in str(f.plan(x, y))
    assert idx.sharding.spec[0] == "q", idx.sharding  # each query row stays where it ran
    got = footprint(f, x, y)
    assert got <= limit, got
    # the 8 devices as one axis: refused, or planned at a larger footprint than this layout's
    # (2.36 MiB at 2b14c86: a floored split of the values held whole, 2,048 chunks of one row
    # per device; this layout: 1.9 MiB)
    one = memsafe.jit(knn, memory_limit=limit, mesh=mesh8())
    try:
        alone = footprint(one, x, y)
    except memsafe.MemoryLimitError:
        pass
    else:
        if alone <= got:
            raise AssertionError(f"one mesh axis of 8 holds {alone} B, this layout {got} B")
    few = memsafe.jit(knn, memory_limit=MiB, mesh=mesh)
    _, idx = few(x[:64], y)
    np.testing.assert_array_equal(np.asarray(idx), knn_reference(x[:64], y))
    split = few.plan(x[:64], y).splits[0]
    assert (split.mesh_axes, split.batch_mesh_axes) == (("q", "d"), ()), split
    print(f"mesh 2x4: queries over q, database over d: {got / MiB:.2f} MiB per device")


def mlp_loss(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    h = jnp.tanh(h @ params["w2"] + params["b2"])
    return jnp.mean((h @ params["w3"] - y) ** 2)


def mlp_data(b: int, d: int = 64, h: int = 512, o: int = 8, seed: int = 5):
    """Parameters of :func:`mlp_loss` (float32, scaled by fan-in) and a batch of ``b`` inputs
    and targets."""
    rng = np.random.default_rng(seed)
    shapes = {"w1": (d, h), "b1": (h,), "w2": (h, h), "b2": (h,), "w3": (h, o)}
    params = {k: (rng.standard_normal(s) / np.sqrt(s[0] * 4)).astype(np.float32)
              for k, s in shapes.items()}  # fmt: skip
    x = rng.standard_normal((b, d)).astype(np.float32)
    y = rng.standard_normal((b, o)).astype(np.float32)
    return params, x, y


def sgd_step(params, x, y):
    """One training step: the loss's gradient over the batch, then plain SGD."""
    grads = jax.grad(mlp_loss)(params, x, y)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def check_train_step() -> None:
    """Data parallel: an MLP's training step with the batch sharded over 8 devices (each
    device loops over micro-batches of its share; the parameter gradients are psum-ed), and
    jax.grad of a memsafe loss, equal to jax.jit, under 8 MiB per device (jax.jit: 53 MiB)."""
    params, x, y = mlp_data(8192)
    limit = 8 * MiB
    step = memsafe.jit(sgd_step, memory_limit=limit, mesh=mesh8())
    got, want = step(params, x, y), jax.jit(sgd_step)(params, x, y)
    for k in params:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-7)
    plan = step.plan(params, x, y)
    assert plan.after.total <= limit < plan.before.total, plan
    split = plan.splits[0]
    assert split.devices == 8 and split.loops > 1 and "dot" in split.sinks, split
    loss = memsafe.jit(mlp_loss, memory_limit=limit, mesh=mesh8())
    grads = jax.grad(loss)(params, x, y)
    ref = jax.jit(jax.grad(mlp_loss))(params, x, y)
    for k in params:
        np.testing.assert_allclose(grads[k], ref[k], rtol=1e-5, atol=1e-8)
    back = loss.plan(params, x, y).backward
    assert back.after.total <= limit and back.splits[0].devices == 8, back
    after, before, grad = (v.total / MiB for v in (plan.after, plan.before, back.after))
    print(f"train step: {after:.2f} MiB per device (jax.jit {before:.1f} MiB), {split.loops} "
          f"micro-batches of {split.chunk} on each device; gradient of a memsafe loss "
          f"{grad:.2f} MiB")  # fmt: skip


def accumulate(x, a, ws, c0):
    """A scan whose body sums over the rows of ``h`` into its carry (a gradient accumulated
    over a batch, layer after layer), from a carry that does not start at zero."""
    h = jnp.tanh(x @ a)

    def body(c, w):
        return c + jnp.sum(jnp.tanh(h * w), 0), None

    return lax.scan(body, c0, ws)[0]


def layered_loss(ws, x, y):
    """An MLP whose layers run as a ``lax.scan`` over their stacked weights (flax ``nn.scan``)."""
    h, _ = lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, ws)
    return jnp.mean((h - y) ** 2)


def fori_layered_loss(ws, x, y):
    """:func:`layered_loss` as a ``fori_loop``: its counter is a carry the same on every device."""
    h = lax.fori_loop(0, len(ws), lambda i, h: jnp.tanh(h @ ws[i]), x)
    return jnp.mean((h - y) ** 2)


def check_summed_scan() -> None:
    """Loop bodies that sum over the split axis, sharded over 8 devices (each device's shares,
    then a psum): the gradient of an MLP written as a scan over its layers, data parallel, and
    the same as a ``fori_loop`` (its counter, read whole, taken from each device as it is), and
    a scan accumulating into a carry that starts at 1000 (counted once: the first device starts
    from it, the others from zero), an axis 8 divides and one it does not."""
    rng = np.random.default_rng(6)
    ws = (rng.standard_normal((6, 256, 256)) / 32).astype(np.float32)
    x, y = (rng.standard_normal((16384, 256)).astype(np.float32) for _ in range(2))
    for loss in (layered_loss, fori_layered_loss):
        grad = jax.grad(loss)
        want = memsafe_jit(grad)(ws, x, y)
        f = memsafe.jit(grad, memory_limit=12 * MiB, mesh=mesh8())  # jax.jit: 371 MiB
        np.testing.assert_allclose(
            f(ws, x, y), want, rtol=1e-4, atol=1e-4 * float(np.abs(want).max())
        )
        split = f.plan(ws, x, y).splits[0]
        assert split.devices == 8 and footprint(f, ws, x, y) <= 12 * MiB, f.plan(ws, x, y)
    for n in (8 * 4096, 8 * 4096 + 3):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        a = (rng.standard_normal((64, 256)) / 8).astype(np.float32)
        ws = rng.standard_normal((5, 256)).astype(np.float32)
        c0 = np.full(256, 1000.0, np.float32)
        f = memsafe.jit(accumulate, memory_limit=6 * MiB, mesh=mesh8())
        want = memsafe_jit(accumulate)(x, a, ws, c0)
        np.testing.assert_allclose(f(x, a, ws, c0), want, rtol=1e-5)
        assert f.plan(x, a, ws, c0).splits[0].devices == 8
        assert footprint(f, x, a, ws, c0) <= 6 * MiB
    print("summed scans: sharded, equal to jax.jit")


def check_flax_scan() -> None:
    """A 4-block flax transformer written with ``nn.scan`` over its layers, its loss and
    gradient with the batch sharded over 8 devices (the backward scan's parameter gradients
    summed over each device's shares, then psum), equal to jax.jit, 32 MiB per device where
    jax.jit on one device needs 674 MiB (26.5 MiB measured)."""
    import deep_models as models

    shape = models.Shape(blocks=4, batch=8, length=512, width=128, heads=4)
    loss, params, batch = models.flax_model(shape, scan=True)
    fun = jax.value_and_grad(loss)
    f = memsafe.jit(fun, memory_limit=32 * MiB, mesh=mesh8())
    got, want = f(params, *batch), memsafe_jit(fun)(params, *batch)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(np.abs(b).max()))
    plan = f.plan(params, *batch)
    assert plan.after.total <= 32 * MiB and plan.splits[0].devices == 8, plan
    print(f"flax nn.scan: {plan.after.total / MiB:.1f} MiB per device on 8 devices")


CHECKS = {
    "knn": check_knn,
    "uneven": check_knn_uneven,
    "placements": check_placements,
    "attention": check_attention,
    "sgpr": check_sgpr,
    "mesh_2d": check_mesh_2d,
    "train_step": check_train_step,
    "summed_scan": check_summed_scan,
    "flax_scan": check_flax_scan,
    "knn_1m": lambda: check_knn(1 << 20, 96 * MiB),
}

if __name__ == "__main__":
    for name in sys.argv[1:]:
        CHECKS[name]()
    print("ok")
