"""memsafe functions under jax.vmap: re-planned at the batched shapes under the same limit and
compiled with memsafe's own options; under an outer jax.jit, one warning (issue 11, defect 3)."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import memsafe
from memsafe.xla import Footprint, memsafe_jit
from tests.fuzz.wrappers import batched_plans

LIMIT = 600_000
B = 4


def kmv(x, y, v):
    k = jnp.exp(-jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, -1) / 2)
    return k @ v


def _data(batch_y: bool = False):
    kx, ky, kv = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (B, 500, 8))
    y = jax.random.normal(ky, (B, 2000, 8) if batch_y else (2000, 8))
    v = jax.random.normal(kv, (2000,))
    return x, y, v


def _close(got, want):
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4 * float(jnp.abs(want).max()))


def test_vmap_replans_under_the_limit(ran):
    """The unbatched plan, batched as it is, would need several times the limit; what runs
    under vmap is a program re-planned at the batched shapes, within the limit."""
    x, y, v = _data()
    g = memsafe.jit(kmv, memory_limit=LIMIT)
    unbatched = g._program((x[0], y, v), {})[0]
    assert unbatched.plan.after.total <= LIMIT
    naive = memsafe_jit(jax.vmap(unbatched.fun, (0, None, None))).lower(x, y, v).compile()
    assert Footprint.from_compiled(naive).total > 2 * LIMIT  # what vmap alone would run
    ran.clear()
    got = jax.vmap(g, in_axes=(0, None, None))(x, y, v)
    _close(got, memsafe_jit(jax.vmap(kmv, (0, None, None)))(x, y, v))
    assert len(ran) == 1 and ran[0] is not None
    assert Footprint.from_compiled(ran[0]).total <= LIMIT


def test_jit_of_vmap_inlines_the_replanned_program():
    """Under jit(vmap), the outer program holds the re-planned batched program: compiled with
    memsafe's options, it fits the limit."""
    x, y, v = _data()
    g = memsafe.jit(kmv, memory_limit=LIMIT)
    outer = memsafe_jit(jax.vmap(g, in_axes=(0, None, None)))
    with pytest.warns(memsafe.OuterJitWarning):
        compiled = outer.lower(x, y, v).compile()
    assert Footprint.from_compiled(compiled).total <= LIMIT
    _close(compiled(x, y, v), memsafe_jit(jax.vmap(kmv, (0, None, None)))(x, y, v))


def _sq(f):
    return lambda *a: jnp.sum(f(*a) ** 2)


AX = (0, 0, None)  # v unbatched
UNB = (0, None, None)  # y and v unbatched

TRANSFORMS = {
    "vmap": lambda f: jax.vmap(f, AX),
    "vmap_in_axes_1": lambda f: (
        lambda x, y, v: jax.vmap(f, in_axes=(1, 0, None))(jnp.moveaxis(x, 0, 1), y, v)
    ),
    "jit_vmap": lambda f: jax.jit(jax.vmap(f, AX)),
    "grad_vmap": lambda f: jax.grad(_sq(jax.vmap(f, AX)), argnums=(0, 1)),
    "vmap_grad": lambda f: jax.vmap(jax.grad(_sq(f), argnums=(0, 1)), AX),
    "nested_vmap": lambda f: (
        lambda x, y, v: jax.vmap(jax.vmap(f, UNB), UNB)(x.reshape(2, B // 2, *x.shape[1:]), y, v)
    ),
}


@pytest.mark.parametrize("name", sorted(TRANSFORMS))
def test_transformations_of_a_memsafe_function(name, ran):
    """vmap, jit(vmap), grad(vmap), vmap(grad), nested vmap and in_axes other than 0, with
    batched and unbatched arguments, give jax.jit's answer (YNNPACK off); every program memsafe
    runs (forward and backward, at the batched shapes) fits the limit."""
    x, y, v = _data(batch_y=name != "nested_vmap")
    g = memsafe.jit(kmv, memory_limit=4 * LIMIT)  # room for batched gradients of x and y
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", memsafe.OuterJitWarning)
        got = TRANSFORMS[name](g)(x, y, v)
    assert (len(ran) == 0) == (name == "jit_vmap")  # under jax.jit the outer program runs
    assert all(Footprint.from_compiled(c).total <= g.memory_limit for c in ran)
    want = memsafe_jit(TRANSFORMS[name](kmv))(x, y, v)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        _close(a, b)


def test_nested_vmap_replans_each_level(ran):
    x, y, v = _data()
    g = memsafe.jit(kmv, memory_limit=LIMIT)
    xs = x.reshape(2, B // 2, *x.shape[1:])
    got = jax.vmap(jax.vmap(g, (0, None, None)), (0, None, None))(xs, y, v)
    _close(got, memsafe_jit(jax.vmap(jax.vmap(kmv, (0, None, None)), (0, None, None)))(xs, y, v))
    assert len(ran) == 1 and Footprint.from_compiled(ran[0]).total <= LIMIT
    assert ran[0].memory_analysis().argument_size_in_bytes >= xs.nbytes  # both levels batched


def test_nan_row_stays_nan_under_vmap():
    """A NaN row gives NaN under vmap as without it (XLA's YNNPACK fusions gave -inf)."""

    def f(x, y):
        return jnp.max(x @ y.T, axis=1)

    kx, ky = jax.random.split(jax.random.PRNGKey(1))
    x = jax.random.normal(kx, (3, 64, 8)).at[1, 5].set(jnp.nan)
    y = jax.random.normal(ky, (3, 96, 8))
    g = memsafe.jit(f, memory_limit="1MiB")
    assert jnp.isnan(g(x[1], y[1])[5])
    got = jax.vmap(g)(x, y)
    np.testing.assert_array_equal(got, memsafe_jit(jax.vmap(f))(x, y))
    assert jnp.isnan(got[1, 5]) and int(jnp.isnan(got).sum()) == 1


def test_outer_jit_warns_once_with_the_remedy():
    g = memsafe.jit(kmv, memory_limit=LIMIT)
    x, y, v = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("error", memsafe.OuterJitWarning)  # eager transformations: none
        g(x[0], y, v)
        jax.vmap(g, UNB)(x, y, v)
        jax.grad(_sq(g))(x[0], y, v)
        jax.vmap(jax.grad(_sq(g)), UNB)(x, y, v)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        jax.jit(g)(x[0], y, v)
        jax.jit(g)(x[1, :300], y, v)  # another shape, another program: still one warning
        jax.jit(jax.vmap(g, UNB))(x, y, v)
        jax.jit(jax.grad(_sq(g)))(x[0], y, v)
    ours = [w for w in caught if issubclass(w.category, memsafe.OuterJitWarning)]
    assert len(ours) == 1
    text = str(ours[0].message)
    assert "kmv" in text and "outside jax.jit" in text and "memsafe.jit" in text
    assert ours[0].filename == __file__  # points at the user's line


def test_memsafe_inside_memsafe_is_planned_whole_without_warning():
    """Inside an outer memsafe.jit (the remedy) the inner function is inlined and split under the
    outer limit, and no warning is given."""
    x, y, v = _data()
    inner = memsafe.jit(kmv, memory_limit="1GiB")
    outer = memsafe.jit(lambda a, b, c: jnp.sum(inner(a, b, c) ** 2), memory_limit=LIMIT)
    with warnings.catch_warnings():
        warnings.simplefilter("error", memsafe.OuterJitWarning)
        got = outer(x[0], y, v)
        plan = outer.plan(x[0], y, v)
    assert not plan.fits_unchanged and plan.after.total <= LIMIT
    _close(got, memsafe_jit(lambda a, b, c: jnp.sum(kmv(a, b, c) ** 2))(x[0], y, v))


@pytest.mark.parametrize(("mode", "times"), [("forward", 1.0), ("gradient", 1.9)])
def test_vmap_runs_unchanged_where_jax_jits_batched_program_fits(mode, times):
    """A 2-block transformer, batch 2 under ``jax.vmap``, at a limit between jax.jit's batched
    footprint and twice it: every batched program runs unchanged (issue 39: one was refused)."""
    from tests.deep_models import Shape, transformer

    loss, params, (x, y) = transformer(Shape(blocks=2, batch=2, length=128, width=32, heads=2))

    def one(p, x, y):  # one sequence
        return loss(p, x[None], y[None])

    f = one if mode == "forward" else jax.grad(one)
    axes = (None, 0, 0)
    jitted = memsafe_jit(jax.vmap(f, in_axes=axes))
    limit = int(Footprint.from_compiled(jitted.lower(params, x, y).compile()).total * times)
    safe = memsafe.jit(one, memory_limit=limit)
    run = safe if mode == "forward" else jax.grad(safe)
    got = jax.vmap(run, in_axes=axes)(params, x, y)
    plans = batched_plans(safe)
    assert plans and all(p.fits_unchanged and p.after.total <= limit for p in plans)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(jitted(params, x, y))):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def test_a_batch_no_batched_program_fits_runs_one_element_at_a_time():
    """A CNN training step under ``jax.vmap`` (batch 3 of 4 images): the batch folds into the
    convolutions' images, and no rewrite of the batched program fits a limit just above one
    element's own footprint plus the batch's arguments and outputs (fuzz seed 10193, issue 39);
    the batch then runs as a ``lax.map`` of the step, verified under the limit, with jax.jit's
    answers."""
    from jax import lax

    def model(kernels, x):
        h = x
        for i, k in enumerate(kernels):
            h = lax.conv_general_dilated(h, k, (1, 1), "SAME", dimension_numbers=_NHWC)
            h = jax.nn.relu(h)
            if i == 1:
                h = lax.reduce_window(h, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "VALID")
        return jnp.mean(h**2)

    step = jax.value_and_grad(model)
    kk, kx = jax.random.split(jax.random.PRNGKey(0))
    kernels = [
        0.2 * jax.random.normal(jax.random.fold_in(kk, i), (3, 3, 2 if i == 0 else 16, 16))
        for i in range(3)
    ]
    x = jax.random.normal(kx, (3, 4, 24, 24, 2))
    batched = memsafe_jit(jax.vmap(step, (None, 0)))
    one = Footprint.from_compiled(memsafe_jit(step).lower(kernels, x[0]).compile())
    limit = 1_750_000  # jax.jit's batched program: 5.3 MB; one step: 1.6 MB
    assert one.total < limit < Footprint.from_compiled(batched.lower(kernels, x).compile()).total
    safe = memsafe.jit(step, memory_limit=limit)
    got = jax.vmap(safe, (None, 0))(kernels, x)
    (plan,) = batched_plans(safe)
    assert not plan.fits_unchanged and plan.after.total <= limit
    assert plan.records[0].pass_name == "one at a time" and "batch of 3" in str(plan)
    for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(batched(kernels, x))):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-5 * float(jnp.abs(r).max()))


_NHWC = ("NHWC", "HWIO", "NHWC")
