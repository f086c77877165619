"""Convolutions split along every axis their dimension numbers name (batch, output feature,
input feature as a sum sink, output spatial axes through windows of the whole input), their
gradients split along the batch axis, and CNN training steps run under the limit with jax.jit's
answers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe
from memsafe.graph import Graph, inline_calls
from memsafe.split import sinks
from memsafe.split.emit import emit
from memsafe.split.planner import strategy
from memsafe.split.prims.conv import TAPS
from memsafe.split.region import grow
from memsafe.split.registry import PLAIN, Mapping, NoRule, axis_map
from memsafe.split.sinks import Sink
from memsafe.xla import Footprint, memsafe_jit
from tests.fuzz.accuracy import check


def _conv(x, w, strides=(1, 1), padding="SAME", dn=("NHWC", "HWIO", "NHWC"), **kw):
    return lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=dn, **kw)


def _arrays(*shapes, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(s, dtype=np.float32)) for s in shapes]


def _split_at(fun, args, axis, chunk, name="conv_general_dilated"):
    """``fun`` with the result of its first ``name`` equation split along ``axis`` in chunks
    of ``chunk`` (a remainder included), evaluated; and jax.jit's answer."""
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    graph = Graph(closed)
    seed = next(e.outvars[0] for e in graph.eqns if e.primitive.name == name)
    region = grow(graph, seed, axis, 1, 10**9)
    new = emit(closed, graph, strategy(graph, region), chunk)
    assert "scan" in str(new.jaxpr)
    got = memsafe_jit(lambda *a: jax.core.eval_jaxpr(new.jaxpr, new.consts, *a))(*args)
    return got, memsafe_jit(fun)(*args)


def _close(got, want, rtol=1e-5):
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        scale = max(1.0, float(np.abs(np.asarray(w)).max()))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=rtol, atol=rtol * scale)


# (name, program, argument shapes, the conv result's axis to split)
SPATIAL = {
    "same_h": (lambda x, w: _conv(x, w), [(2, 23, 19, 3), (3, 3, 3, 5)], 1),
    "same_w": (lambda x, w: _conv(x, w), [(2, 23, 19, 3), (3, 3, 3, 5)], 2),
    "valid_stride2": (
        lambda x, w: _conv(x, w, (2, 3), "VALID"),
        [(2, 29, 31, 3), (5, 4, 3, 4)],
        1,
    ),
    "padded_strided_w": (
        lambda x, w: _conv(x, w, (2, 3), ((2, 1), (3, 0))),
        [(2, 29, 31, 3), (5, 4, 3, 4)],
        2,
    ),
    "negative_padding": (
        lambda x, w: _conv(x, w, (1, 2), ((-2, 3), (1, -1))),
        [(2, 29, 31, 3), (3, 3, 3, 4)],
        1,
    ),
    "rhs_dilated": (
        lambda x, w: _conv(x, w, (1, 1), "SAME", rhs_dilation=(3, 2)),
        [(2, 29, 31, 3), (3, 3, 3, 4)],
        1,
    ),
    "lhs_dilated": (
        lambda x, w: _conv(x, w, (1, 2), ((2, 1), (1, 2)), lhs_dilation=(2, 3)),
        [(2, 17, 13, 3), (3, 4, 3, 4)],
        1,
    ),
    "nchw": (
        lambda x, w: _conv(x, w, (2, 1), "SAME", ("NCHW", "OIHW", "NCHW")),
        [(2, 3, 29, 31), (4, 3, 3, 5)],
        2,
    ),
    "nchw_w": (
        lambda x, w: _conv(x, w, (2, 1), "SAME", ("NCHW", "OIHW", "NCHW")),
        [(2, 3, 29, 31), (4, 3, 3, 5)],
        3,
    ),
    "one_d": (
        lambda x, w: lax.conv_general_dilated(x, w, (2,), ((3, 1),), (1,), (2,)),
        [(2, 3, 101), (4, 3, 5)],
        2,
    ),
    "grouped": (
        lambda x, w: _conv(x, w, (1, 1), "SAME", feature_group_count=3),
        [(2, 23, 19, 6), (3, 3, 2, 9)],
        1,
    ),
}


@pytest.mark.parametrize("name", sorted(SPATIAL))
def test_spatial_axis_reads_windows_of_the_input(name):
    """Output rows in chunks (with a remainder) read their halo of the whole input: padding,
    strides and both dilations, NHWC and NCHW, equal jax.jit. The input has NaN and inf."""
    fun, shapes, axis = SPATIAL[name]
    x, w = _arrays(*shapes)
    x = x.at[(0,) * (x.ndim - 1) + (1,)].set(jnp.nan).at[(1,) * x.ndim].set(jnp.inf)
    chunk = max(2, fun(x, w).shape[axis] // 3 - 1)
    got, want = _split_at(lambda x, w: jnp.tanh(fun(x, w)), [x, w], axis, chunk)
    _close(got[0], want)


def _conv_eqn(fun, *args):
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    return next(e for e in Graph(closed).eqns if e.primitive.name == "conv_general_dilated")


def test_axis_maps_from_the_dimension_numbers():
    x, w = jnp.ones((2, 3, 9, 8)), jnp.ones((5, 3, 3, 3))  # NCHW, OIHW
    eqn = _conv_eqn(lambda x, w: _conv(x, w, dn=("NCHW", "OIHW", "NCHW")), x, w)
    assert axis_map(eqn, ("in", 0), 0, PLAIN) == Mapping(ins=(0, None), outs=(0,))
    assert axis_map(eqn, ("out", 0), 1, PLAIN) == Mapping(ins=(None, 0), outs=(1,))
    assert axis_map(eqn, ("in", 0), 1, PLAIN) == Sink(sinks.DOT, ins=(1, 1))
    assert axis_map(eqn, ("in", 1), 1, PLAIN) == Sink(sinks.DOT, ins=(1, 1))
    assert axis_map(eqn, ("out", 0), 3, PLAIN) == Mapping(ins=(None, None), outs=(3,))
    with pytest.raises(NoRule, match="overlapping windows"):
        axis_map(eqn, ("in", 0), 2, PLAIN)
    assert axis_map(eqn, ("in", 1), 2, PLAIN) == Sink(TAPS, ins=(None, 2))
    nhwc = _conv_eqn(lambda x, w: _conv(x, w), jnp.ones((2, 9, 8, 3)), jnp.ones((1, 1, 3, 5)))
    assert axis_map(nhwc, ("in", 0), 1, PLAIN) == Mapping(ins=(1, None), outs=(1,))  # 1x1: passes
    assert axis_map(nhwc, ("in", 1), 3, PLAIN) == Mapping(ins=(None, 3), outs=(3,))
    assert axis_map(nhwc, ("in", 0), 3, PLAIN) == Sink(sinks.DOT, ins=(3, 2))


def test_grouped_feature_axes_are_refused_by_name():
    x, w = jnp.ones((4, 9, 8, 6)), jnp.ones((3, 3, 2, 9))
    eqn = _conv_eqn(lambda x, w: _conv(x, w, feature_group_count=3), x, w)
    assert axis_map(eqn, ("in", 0), 0, PLAIN) == Mapping(ins=(0, None), outs=(0,))
    with pytest.raises(NoRule, match="feature_group_count=3 along its output-feature axis"):
        axis_map(eqn, ("out", 0), 3, PLAIN)
    with pytest.raises(NoRule, match="feature_group_count=3 along its input-feature axis"):
        axis_map(eqn, ("in", 0), 3, PLAIN)
    eqn = _conv_eqn(lambda x, w: _conv(x, w, batch_group_count=2), x, jnp.ones((3, 3, 6, 4)))
    with pytest.raises(NoRule, match="batch_group_count=2 along its batch axis"):
        axis_map(eqn, ("in", 0), 0, PLAIN)


# (program, argument shapes, the axis of the conv result to split)
AXES = {
    "batch": (lambda x, w: _conv(x, w, (2, 1)), [(9, 12, 10, 3), (3, 3, 3, 8)], 0),
    "out_feature": (lambda x, w: _conv(x, w, (2, 1)), [(3, 12, 10, 3), (3, 3, 3, 23)], 3),
    "out_feature_nchw": (
        lambda x, w: _conv(x, w, (1, 1), "VALID", ("NCHW", "OIHW", "NCHW")),
        [(3, 4, 12, 10), (23, 4, 3, 3)],
        1,
    ),
}


@pytest.mark.parametrize("name", sorted(AXES))
def test_batch_and_feature_axes_pass(name):
    fun, shapes, axis = AXES[name]
    x, w = _arrays(*shapes, seed=1)
    got, want = _split_at(lambda x, w: jnp.max(jnp.sin(fun(x, w)), axis=(1, 2)), [x, w], axis, 4)
    _close(got[0], want)


def test_input_features_are_a_sum_sink():
    """The conv's input channels are contracted: chunks of them (input and kernel) are summed."""
    x, w, v = _arrays((3, 12, 10, 64), (3, 3, 64, 5), (3, 12, 10, 64), seed=2)

    def fun(x, w, v):
        return _conv(jnp.cos(x) * v, w)

    closed = inline_calls(jax.make_jaxpr(fun)(x, w, v))
    graph = Graph(closed)
    seed = next(e.outvars[0] for e in graph.eqns if e.primitive.name == "mul")
    region = grow(graph, seed, 3, 1, 10**9)
    assert [s.kind for s in region.sinks.values()] == ["dot"]
    new = emit(closed, graph, strategy(graph, region), 24)
    got = memsafe_jit(lambda *a: jax.core.eval_jaxpr(new.jaxpr, new.consts, *a))(x, w, v)
    _close(got[0], memsafe_jit(fun)(x, w, v), rtol=1e-4)


def _max_pool(x, window=(1, 3, 3, 1), strides=(1, 2, 2, 1), padding="VALID"):
    return lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding)


def _avg_pool(x, window=(1, 2, 3, 1), strides=(1, 2, 1, 1), padding="SAME"):
    return lax.reduce_window(x, 0.0, lax.add, window, strides, padding) / 6


def _min_dilated(x):
    pad = ((2, 1), (0, 0), (1, 1), (0, 0))
    dilation = {"base_dilation": (1, 2, 1, 1), "window_dilation": (1, 1, 2, 1)}
    return lax.reduce_window(x, jnp.inf, lax.min, (1, 3, 2, 1), (1, 2, 1, 1), pad, **dilation)


def _general_pool(x):
    def fold(a, b):
        return a[0] + b[0], a[1] * b[1]

    return lax.reduce_window((x, jnp.cos(x)), (0.0, 1.0), fold, (1, 3, 1, 1), (1, 2, 1, 1), "SAME")


POOLS = {
    "max_valid": (_max_pool, 1),
    "max_same_w": (lambda x: _max_pool(x, padding="SAME"), 2),
    "min_dilated": (_min_dilated, 2),
    "avg_same": (_avg_pool, 1),
    "int_max": (lambda x: _max_pool((x * 4).astype(jnp.int32), padding="SAME"), 1),
    "general": (_general_pool, 1),
    "channels": (_max_pool, 3),
}


@pytest.mark.parametrize("name", sorted(POOLS))
def test_pooling_splits_along_pooled_and_passing_axes(name):
    """Pooled axes read their windows (padding with the reduction's identity), the others pass;
    -inf, inf and NaN in the input keep jax.jit's answer."""
    fun, axis = POOLS[name]
    (x,) = _arrays((3, 23, 21, 5), seed=3)
    x = x.at[0, 4, 4, 0].set(jnp.nan).at[1, 0, 0, 1].set(-jnp.inf).at[2, -1, -1, 2].set(jnp.inf)
    pool = next(
        e.primitive.name
        for e in inline_calls(jax.make_jaxpr(fun)(x)).jaxpr.eqns
        if e.primitive.name.startswith("reduce_window")
    )
    got, want = _split_at(
        lambda x: jax.tree.map(jnp.tanh, fun(jnp.sin(x))), [x], axis, 2, name=pool
    )
    _close(got, want)


def _max_pool_grad(x, window, strides):
    return jax.grad(lambda x: jnp.sum(jnp.sin(_max_pool(x, window, strides)) * 3))(x)


@pytest.mark.parametrize(
    ("window", "strides", "axis"),
    [
        ((1, 3, 3, 1), (1, 2, 2, 1), 1),
        ((1, 2, 2, 1), (1, 2, 2, 1), 2),
        ((1, 2, 3, 1), (1, 4, 1, 1), 1),
        ((1, 3, 3, 1), (1, 2, 2, 1), 0),
        ((1, 3, 3, 1), (1, 2, 2, 1), 3),
    ],
)
def test_max_pool_gradient_scatters_per_chunk(window, strides, axis):
    """select_and_scatter_add: chunks of the input gradient gather the windows overlapping
    them; ties (integer values) go where jax.jit sends them."""
    (x,) = _arrays((5, 23, 21, 6), seed=4)
    x = jnp.round(x * 2)  # many ties inside windows
    got, want = _split_at(
        lambda x: jnp.tanh(_max_pool_grad(x, window, strides)),
        [x],
        axis,
        2,
        name="select_and_scatter_add",
    )
    _close(got, want)


def _max_pool_tangent(x, t, window, strides):
    """``jax.jvp`` of a max pooling (as in a gradient of a gradient): ``select_and_gather_add``."""
    return jax.jvp(lambda x: _max_pool(x, window, strides), (x,), (t,))[1]


@pytest.mark.parametrize(
    ("window", "strides", "axis"),
    [
        ((1, 3, 3, 1), (1, 2, 2, 1), 1),
        ((1, 2, 2, 1), (1, 2, 2, 1), 2),
        ((1, 3, 3, 1), (1, 2, 2, 1), 0),
        ((1, 3, 3, 1), (1, 2, 2, 1), 3),
    ],
)
def test_max_pool_tangent_gathers_per_chunk(window, strides, axis):
    """select_and_gather_add: along the batch and channel axes it passes; a chunk of a pooled
    axis selects over its windows of the whole operands; ties (integer values) picked where
    jax.jit picks them."""
    x, t = _arrays((5, 23, 21, 6), (5, 23, 21, 6), seed=5)
    x = jnp.round(x * 2)  # many ties inside windows
    got, want = _split_at(
        lambda x, t: jnp.tanh(_max_pool_tangent(x, t, window, strides)),
        [x, t],
        axis,
        2,
        name="select_and_gather_add",
    )
    _close(got, want)


def test_padded_select_and_gather_is_refused():
    x = jnp.ones((2, 8, 8, 3))
    pool = lambda x: _max_pool(x, padding="SAME")
    tangent = lambda x, t: jax.jvp(jax.grad(lambda x: jnp.sum(pool(x) ** 2)), (x,), (t,))[1]
    closed = inline_calls(jax.make_jaxpr(tangent)(x, x))
    eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "select_and_gather_add")
    assert axis_map(eqn, ("out", 0), 0, PLAIN) == Mapping(ins=(0, 0), outs=(0,))
    with pytest.raises(NoRule, match="select_and_gather_add along a padded axis"):
        axis_map(eqn, ("out", 0), 1, PLAIN)


def test_padded_select_and_scatter_is_refused():
    x = jnp.ones((2, 8, 8, 3))
    closed = inline_calls(jax.make_jaxpr(jax.grad(lambda x: _max_pool(x, padding="SAME").sum()))(x))
    eqn = next(e for e in closed.jaxpr.eqns if e.primitive.name == "select_and_scatter_add")
    assert axis_map(eqn, ("out", 0), 0, PLAIN) == Mapping(ins=(0, 0), outs=(0,))
    with pytest.raises(NoRule, match="padded axis"):
        axis_map(eqn, ("out", 0), 1, PLAIN)


KERNEL_GRADS = {
    "same": ((1, 1), "SAME", {}),
    "strided": ((2, 3), ((2, 1), (0, 2)), {}),
    "dilated": ((1, 2), "SAME", {"rhs_dilation": (2, 3)}),
    "nchw": ((2, 1), "VALID", {"dn": ("NCHW", "OIHW", "NCHW")}),
}


@pytest.mark.parametrize("name", sorted(KERNEL_GRADS))
def test_kernel_gradient_sums_chunks_of_its_taps(name):
    """The kernel gradient is a convolution contracting the cotangent's spatial axis (its
    "kernel" taps): chunks of the cotangent read their window of the whole input and sum."""
    strides, padding, kw = KERNEL_GRADS[name]
    nchw = "dn" in kw
    x, w = _arrays(
        (2, 3, 37, 31) if nchw else (2, 37, 31, 3), (5, 3, 3, 3) if nchw else (3, 3, 3, 5)
    )

    def grad(x, w):
        return jax.grad(lambda w: jnp.sum(jnp.sin(_conv(x, w, strides, padding, **kw))))(w)

    closed = inline_calls(jax.make_jaxpr(grad)(x, w))
    graph = Graph(closed)
    convs = [e for e in graph.eqns if e.primitive.name == "conv_general_dilated"]
    seed = convs[0].outvars[0]  # the forward conv: split along its rows
    region = grow(graph, seed, 2 if nchw else 1, 1, 10**9)
    assert "conv taps" in [s.kind for s in region.sinks.values()]
    new = emit(closed, graph, strategy(graph, region), 4)
    got = memsafe_jit(lambda *a: jax.core.eval_jaxpr(new.jaxpr, new.consts, *a))(x, w)
    _close(got[0], memsafe_jit(grad)(x, w), rtol=1e-4)


# -- end to end: memsafe.jit under a limit, against jax.jit ---------------------------------------


def _float64(fun, *args):
    with jax.enable_x64():
        wide = jax.tree.map(lambda a: np.asarray(a, np.float64) if a.dtype.kind == "f" else a, args)
        return memsafe_jit(fun)(*wide)


def _footprint(fun, args):
    return Footprint.from_compiled(memsafe_jit(fun).lower(*args).compile())


def _a_third(fun, args):
    """A third of jax.jit's footprint."""
    return _footprint(fun, args).total // 3


def _a_quarter_of_temps(fun, args):
    """Arguments and outputs, and a quarter of jax.jit's temporaries."""
    plain = _footprint(fun, args)
    fixed = plain.arguments + plain.outputs
    return fixed + (plain.total - fixed) // 4


def _under_limit(fun, args, limit):
    """memsafe's plan of ``fun`` under ``limit(fun, args)`` bytes, checked: it splits, meets the
    limit, and its answers obey the accuracy rule against jax.jit and a float64 reference."""
    limit = limit(fun, args)
    f = memsafe.jit(fun, memory_limit=limit)
    plan = f.plan(*args)
    assert plan.splits and plan.after.total <= limit, plan
    assert check(f(*args), memsafe_jit(fun)(*args), _float64(fun, *args)) == []
    return plan


def _two_convs(params, x):
    """The issue's program: two 3x3 convolutions with ReLU, a sum of squares."""
    w1, w2 = params
    h = jax.nn.relu(_conv(x, w1))
    return jnp.sum(jax.nn.relu(_conv(h, w2)) ** 2)


def test_issue_two_convs_relu_gradient_splits_the_batch():
    """Issue 12's case, scaled down (batch 32 of 32x32x16; refused with "no splitting rule for
    primitive 'conv_general_dilated'" before): under a third of jax.jit's footprint."""
    x, w1, w2 = _arrays((32, 32, 32, 16), (3, 3, 16, 16), (3, 3, 16, 16), seed=5)
    params = (w1 * 0.1, w2 * 0.1)
    plan = _under_limit(jax.grad(_two_convs), [params, x], _a_third)
    assert {s.axis for s in plan.splits} == {0}


def _image_features(w, x):
    """A strided depthwise 5x5 convolution of one large image (grouped: its features cannot
    split), ReLU, global average pooling."""
    h = jax.nn.relu(_conv(x, w, (2, 1), ((2, 2), (1, 2)), feature_group_count=x.shape[-1]))
    return jnp.mean(h, (1, 2))


@pytest.mark.parametrize("grad", [False, True])
def test_one_large_image_splits_along_its_rows(grad):
    """Batch 1: only a spatial axis can split. Rows of the result read their halo of the image;
    the kernel gradient sums chunks of its taps."""
    x, w = _arrays((1, 256, 256, 8), (5, 5, 1, 32), seed=6)
    fun = _image_features
    if grad:
        fun = jax.grad(lambda w, x: jnp.sum(jnp.sin(_image_features(w, x))))
    plan = _under_limit(fun, [w * 0.1, x], _a_quarter_of_temps)
    assert {s.axis for s in plan.splits} <= {1, 2}


GRADIENTS = {
    "nchw_strided": (
        lambda x, w: _conv(x, w, (2, 2), "SAME", ("NCHW", "OIHW", "NCHW")),
        [(32, 16, 32, 32), (16, 16, 3, 3)],
    ),
    "nhwc_dilated": (
        lambda x, w: _conv(x, w, (1, 1), ((2, 2), (2, 2)), rhs_dilation=(2, 2)),
        [(32, 32, 32, 16), (3, 3, 16, 16)],
    ),
}


@pytest.mark.parametrize("name", sorted(GRADIENTS))
def test_conv_gradients_under_the_limit(name):
    """Input and kernel gradients (a dilated convolution against the reversed kernel, and a
    convolution contracting the batch axis) split along the batch."""
    conv, shapes = GRADIENTS[name]
    x, w = _arrays(*shapes, seed=7)
    fun = jax.grad(lambda x, w: jnp.sum(jnp.tanh(conv(x, w)) ** 2), argnums=(0, 1))
    plan = _under_limit(fun, [x, w * 0.1], _a_quarter_of_temps)
    assert {s.axis for s in plan.splits} == {0}


# -- a ResNet-style CNN: conv, batch-norm with batch statistics, ReLU, pooling, residual ----------


def _batch_norm(x, gamma, beta):
    mean, var = jnp.mean(x, (0, 1, 2)), jnp.var(x, (0, 1, 2))
    return (x - mean) * lax.rsqrt(var + 1e-5) * gamma + beta


def _resnet_loss(p, x, labels):
    """A stem and one residual block (3x3 convs, batch-norm, ReLU), max pooling, global average
    pooling, a dense head, mean cross-entropy."""
    h = jax.nn.relu(_batch_norm(_conv(x, p["w0"]), p["g0"], p["b0"]))
    r = jax.nn.relu(_batch_norm(_conv(h, p["w1"]), p["g1"], p["b1"]))
    r = _batch_norm(_conv(r, p["w2"]), p["g2"], p["b2"])
    h = _max_pool(jax.nn.relu(h + r), (1, 2, 2, 1), (1, 2, 2, 1))
    logits = jnp.mean(h, (1, 2)) @ p["wd"] + p["bd"]
    return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(labels, 10), -1))


def _resnet_inputs(batch=32, size=32, channels=16):
    c = channels
    shapes = {"w0": (3, 3, 3, c), "w1": (3, 3, c, c), "w2": (3, 3, c, c), "wd": (c, 10)}
    shapes |= {k: (c,) for k in ("g0", "b0", "g1", "b1", "g2", "b2")} | {"bd": (10,)}
    values = _arrays(*shapes.values(), (batch, size, size, 3), seed=8)
    params = {k: 0.2 * v + (k[0] == "g") for k, v in zip(shapes, values)}
    labels = jnp.asarray(np.random.default_rng(8).integers(0, 10, batch))
    return params, values[-1], labels


@pytest.mark.slow
def test_resnet_gradient_fits_a_third():
    """No single activation of the CNN's gradient is over a quarter of the budget: the engine
    splits values down to a sixteenth (policy.SPLIT.many_share). One region splits the whole
    training step along the batch in 13 stages: batch statistics are exact sum sinks, each
    normalization a later stage, the parameter gradients sum sinks; jax.jit's answers."""
    fun, args = jax.grad(_resnet_loss), _resnet_inputs()
    plan = _under_limit(fun, args, _a_third)
    assert {s.axis for s in plan.splits} == {0}
