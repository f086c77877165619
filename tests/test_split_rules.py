"""Per-primitive axis rules: each program routes the split axis through one kind of operation,
runs under a quarter of plain jit's temporaries, and equals jax.jit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe.graph import Graph, inline_calls
from memsafe.split import sinks
from memsafe.split.registry import PLAIN, Mapping, NoRule, Through, axis_map, rebind
from memsafe.split.sinks import Sink
from memsafe.xla import Footprint, memsafe_jit

N, M, D = 256, 2048, 8


def _scores(x, y):
    return x @ y.T


PROGRAMS = {
    "reshape": lambda x, y, t: jnp.sum(_scores(x, y).reshape(N, M // 4, 4), axis=(1, 2)),
    "transpose_expand": lambda x, y, t: jnp.sum(jnp.exp(_scores(x, y).T[None] * 0.1), (0, 1)),
    "concatenate": lambda x, y, t: jnp.concatenate([_scores(x, y), 2 * _scores(x, y)], 1).max(1),
    "cumsum_other_axis": lambda x, y, t: jnp.cumsum(_scores(x, y), axis=1)[:, -1],
    "where_row_vector": lambda x, y, t: jnp.where(_scores(x, y) > t[None], 1.0, -1.0).sum(0),
    "int_sum": lambda x, y, t: (_scores(x, y) > 0).astype(jnp.int32).sum(1),
    "mean_var": lambda x, y, t: jnp.var(_scores(x, y), axis=0),
    "sort_other_axis": lambda x, y, t: jnp.sort(_scores(x, y), axis=1)[:, -3:],
    "pad_other_axis": lambda x, y, t: jnp.pad(_scores(x, y), ((0, 0), (1, 2))).min(1),
    "batched_einsum": lambda x, y, t: jnp.einsum(
        "bnd,bmd->bnm", x.reshape(4, N // 4, D), y.reshape(4, M // 4, D)
    ).max(2),
    "abs_l1": lambda x, y, t: jnp.min(jnp.sum(jnp.abs(x[:, None] - y[None]), -1), 0),
    "argmin_columns": lambda x, y, t: jnp.argmin(jnp.cos(_scores(x, y)), 0),
    "stack": lambda x, y, t: jnp.stack([_scores(x, y), jnp.sin(_scores(x, y))], 1).max(1).sum(1),
    "unstack": lambda x, y, t: jnp.prod(
        jnp.stack(jnp.unstack(jnp.stack([_scores(x, y), jnp.sin(_scores(x, y))], 1), axis=1)), 0
    ).sum(1),
    "scatter_max_rows": lambda x, y, t: jax.vmap(
        lambda r: jnp.zeros(16).at[jnp.arange(M) % 16].max(r)
    )(_scores(x, y)),
    "clz": lambda x, y, t: lax.clz((_scores(x, y) * 100).astype(jnp.int32)).sum(1),
    "bessel_i0e": lambda x, y, t: jax.scipy.special.i0e(_scores(x, y)).sum(1),
    "offset_slices": lambda x, y, t: (
        _scores(x, y)[:, 5::7].sum(1),
        jnp.exp(_scores(x, y))[3::5, -1],
    ),
    "lax_map_rows": lambda x, y, t: lax.map(lambda r: jnp.exp(0.1 * r @ y.T), x).max(0),
    "prod_and_any": lambda x, y, t: (
        jnp.prod(jnp.tanh(_scores(x, y)) * 0.01 + 1, 1),
        jnp.any(_scores(x, y) > 3, 1),
    ),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_rule_programs_split_and_match(name):
    fun = PROGRAMS[name]
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((N, D), dtype=np.float32))
    y = jnp.asarray(rng.standard_normal((M, D), dtype=np.float32))
    t = jnp.asarray(rng.standard_normal((M,), dtype=np.float32))
    plain = Footprint.from_compiled(memsafe_jit(fun).lower(x, y, t).compile())
    fixed = plain.arguments + plain.outputs
    limit = fixed + (plain.total - fixed) // 4
    f = memsafe.jit(fun, memory_limit=limit)
    out = f(x, y, t)
    plan = f.plan(x, y, t)
    assert plan.splits and plan.after.total <= limit, plan
    for o, r in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(fun(x, y, t))):
        o, r = np.asarray(o), np.asarray(r)
        if o.dtype.kind in "biu":
            np.testing.assert_array_equal(o, r)
        else:
            scale = max(1.0, float(np.abs(r).max()))
            np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-4 * scale)


def _eqn(fun, *args, name):
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    return next(e for e in Graph(closed).eqns if e.primitive.name == name)


def test_rule_mappings():
    a = jnp.ones((4, 6))
    dot = _eqn(lambda a: a @ a.T, a, name="dot_general")
    assert axis_map(dot, ("in", 0), 0, PLAIN) == Mapping(ins=(0, None), outs=(0,))
    assert axis_map(dot, ("in", 0), 1, PLAIN) == Sink(sinks.DOT, ins=(1, 0))
    assert axis_map(dot, ("out", 0), 1, PLAIN) == Mapping(ins=(None, 1), outs=(1,))
    bcast = _eqn(lambda a: a[:, None, :] + jnp.zeros((4, 5, 6)), a, name="broadcast_in_dim")
    assert axis_map(bcast, ("out", 0), 2, PLAIN) == Mapping(ins=(1,), outs=(2,))
    assert axis_map(bcast, ("out", 0), 1, PLAIN) == Mapping(ins=(None,), outs=(1,))
    reshape = _eqn(lambda a: a.reshape(2, 2, 6), a, name="reshape")
    assert axis_map(reshape, ("in", 0), 1, PLAIN) == Mapping(ins=(1,), outs=(2,))
    with pytest.raises(NoRule, match="merges or splits"):
        axis_map(reshape, ("in", 0), 0, PLAIN)
    topk = _eqn(lambda a: lax.top_k(a, 2), a, name="top_k")
    assert axis_map(topk, ("in", 0), 1, PLAIN) == Sink(sinks.TOP_K, ins=(1,))
    assert axis_map(topk, ("in", 0), 0, PLAIN) == Mapping(ins=(0,), outs=(0, 0))
    cumsum = _eqn(lambda a: lax.cumsum(a, axis=1), a, name="cumsum")
    assert axis_map(cumsum, ("in", 0), 1, PLAIN) == Mapping(ins=(1,), outs=(1,))  # a running carry
    reverse = _eqn(lambda a: lax.cumsum(a, axis=1, reverse=True), a, name="cumsum")
    carried = Mapping(ins=(1,), outs=(1,))  # carried from the end
    assert axis_map(reverse, ("in", 0), 1, PLAIN) == carried
    squeeze = _eqn(lambda a: lax.squeeze(a[:, :1], (1,)), a, name="squeeze")
    assert axis_map(squeeze, ("in", 0), 0, PLAIN) == Mapping(ins=(0,), outs=(0,))
    with pytest.raises(NoRule, match="size-1 axis"):
        axis_map(squeeze, ("in", 0), 1, PLAIN)
    tail = _eqn(lambda a: a[:, 1:], a, name="slice")
    assert axis_map(tail, ("in", 0), 1, PLAIN) == Sink(sinks.SLICE, ins=(1,))
    assert axis_map(tail, ("out", 0), 1, PLAIN) == Mapping(ins=(None,), outs=(1,))  # read whole
    fft = _eqn(lambda a: jnp.fft.fft(a), a, name="fft")
    with pytest.raises(NoRule, match="no splitting rule for primitive 'fft'"):
        axis_map(fft, ("in", 0), 0, PLAIN)


def test_a_checkpointed_call_runs_on_a_chunk_where_its_body_maps_the_axis():
    """A chunk loop's checkpointed chunk body, met by a later split along another axis: the
    call maps the axis through its body and runs re-traced on each chunk, checkpointed again."""
    a = jax.random.normal(jax.random.key(0), (6, 10))
    t = jax.random.normal(jax.random.key(1), (10,))

    def call(a, t):
        return jax.checkpoint(lambda a, t: (jnp.sin(a) * t, jnp.cumsum(a, 1)))(a, t)

    closed = jax.make_jaxpr(call)(a, t)
    eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "remat2")
    m = axis_map(eqn, ("in", 0), 0, PLAIN)
    assert m == Through(ins=(0, None), outs=(0, 0), ctx=PLAIN)
    assert axis_map(eqn, ("out", 1), 0, PLAIN) == m
    with pytest.raises(NoRule):
        axis_map(eqn, ("in", 0), 1, PLAIN)  # the body scans along it

    def chunk(start, part):
        out = rebind(eqn, [part, t], m, start, part.shape[0])
        assert any(
            e.primitive.name == "remat2"
            for e in jax.make_jaxpr(lambda p: rebind(eqn, [p, t], m, start, part.shape[0]))(
                part
            ).jaxpr.eqns
        )
        return out

    got = [chunk(0, a[:4]), chunk(4, a[4:])]
    for k, want in enumerate(call(a, t)):
        np.testing.assert_allclose(jnp.concatenate([g[k] for g in got]), want, rtol=1e-6)


def test_scans_in_both_directions_along_the_axis_share_no_loop():
    """One loop visits its chunks in one order: a value scanned both ways along the axis (a
    cumsum and its gradient's reverse cumsum) is not run in one loop along that axis; the rows
    split instead."""

    def fun(x, y):
        s = jnp.tanh(x @ y.T)
        return jnp.max(jnp.cumsum(s, 1) * lax.cumsum(s, 1, reverse=True), 1)

    x = jax.random.normal(jax.random.key(0), (4, 2))
    y = jax.random.normal(jax.random.key(1), (60_000, 2))
    plain = Footprint.from_compiled(memsafe_jit(fun).lower(x, y).compile())
    fixed = plain.arguments + plain.outputs
    f = memsafe.jit(fun, memory_limit=fixed + (plain.total - fixed) // 2)
    assert [s.axis for s in f.plan(x, y).splits] == [0], f.plan(x, y)
    np.testing.assert_allclose(f(x, y), memsafe_jit(fun)(x, y), rtol=1e-5)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize("op", ["cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp"])
def test_scans_along_the_split_axis_carry_between_chunks(op, reverse):
    """A running carry: each chunk's scan continues from the last value of the chunk before; a
    reverse scan visits the chunks last first, and an argmax in the same loop still gives the
    first of tied maxima."""
    scan = getattr(lax, op)

    def fun(x, y):
        s = jnp.tanh(x @ y.T) * 0.5 + (1.0 if op == "cumprod" else 0.0)
        c = scan(s, axis=1, reverse=reverse)
        ties = jnp.argmax(jnp.round(s * 2), axis=1)
        return jnp.max(c * 0.5, axis=1), c[:, 0 if reverse else -1], ties

    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 2), dtype=np.float32)
    y = rng.standard_normal((60_000, 2), dtype=np.float32)
    x[1, 0] = np.nan  # a NaN row stays NaN from its first chunk on
    plain = Footprint.from_compiled(memsafe_jit(fun).lower(x, y).compile())
    fixed = plain.arguments + plain.outputs
    limit = fixed + (plain.total - fixed) // 4
    f = memsafe.jit(fun, memory_limit=limit)
    (split,) = f.plan(x, y).splits
    assert split.axis == 1 and split.loops >= 2
    assert f.plan(x, y).after.total <= limit
    want = memsafe_jit(fun)(x, y)
    out = f(x, y)
    np.testing.assert_array_equal(out[2], want[2])
    for got, ref in zip(out[:2], want[:2]):
        np.testing.assert_allclose(got, ref, rtol=2e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32, jnp.int32])
def test_a_chunk_of_an_iota_is_the_whole_iotas_positions_exactly(dtype):
    """Positions are counted in integers and converted once, as the whole ``iota`` does: a
    bfloat16 ``iota`` shifted in its own dtype rounds twice (fuzz seed 3919: an ``argmin`` over
    ``s + iota * 1e-3`` picked other rows in 2 of 907 columns)."""
    closed = jax.make_jaxpr(lambda: lax.iota(dtype, 907))()
    (eqn,) = closed.jaxpr.eqns
    whole = np.asarray(lax.iota(dtype, 907)).astype(np.float64)
    for start, size in [(0, 227), (680, 227), (453, 454), (906, 1)]:
        (got,) = rebind(eqn, [], Mapping(ins=(), outs=(0,)), jnp.int32(start), size)
        assert got.dtype == dtype
        np.testing.assert_array_equal(
            np.asarray(got).astype(np.float64), whole[start : start + size]
        )


def test_argmin_over_a_bfloat16_iota_split_along_it_agrees_with_jax_jit():
    """Fuzz seed 3919's piece: the columns split, each column's argmin over rows of values
    shifted by a bfloat16 ``iota`` along the columns."""
    rng = np.random.default_rng(3919)
    x = jnp.asarray(rng.standard_normal((60, 4)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((907, 4)), jnp.bfloat16)

    def f(x, y):
        s = x[:, :1] - y[:, 0][None, :]
        s = s + jnp.arange(907, dtype=s.dtype)[None, :] * 1e-3
        s = (s > 0).astype(s.dtype) * s
        return jnp.argmin(jnp.where(s < 1.0, s, jnp.sin(s)), 0)

    want = memsafe_jit(f)(x, y)
    whole = Footprint.from_compiled(memsafe_jit(f).lower(x, y).compile())
    fixed = whole.arguments + whole.outputs
    g = memsafe.jit(f, memory_limit=fixed + (whole.total - fixed) // 3)
    assert g.plan(x, y).splits
    np.testing.assert_array_equal(np.asarray(g(x, y)), np.asarray(want))
