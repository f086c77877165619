"""Halos across layers: stride-1 convolutions in a row run in one region on extended chunks
(memsafe.split.strategies.halo), forward and gradient, against jax.jit, with NaN and infinities."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import Phase, example, given, settings
from hypothesis import strategies as st
from jax import lax

import memsafe
from memsafe import primitives
from memsafe.graph import Graph, inline_calls
from memsafe.primitives import Facts, Kind
from memsafe.split.emit import emit
from memsafe.split.planner import strategy
from memsafe.split.region import SplitFailure, grow
from memsafe.split.strategies import halo
from memsafe.xla import memsafe_jit
from tests.budget import examples
from tests.fuzz.accuracy import check
from tests.test_conv import (
    _a_quarter_of_temps,
    _a_third,
    _arrays,
    _float64,
    _resnet_inputs,
    _resnet_loss,
    _under_limit,
)

LAYOUTS = {"nhwc": ("NHWC", "HWIO", "NHWC"), "nchw": ("NCHW", "OIHW", "NCHW")}
ACTIVATIONS = {"relu": jax.nn.relu, "tanh": jnp.tanh, "silu": jax.nn.silu, "none": lambda h: h}


POOLS = [None, None, ("max", 2, 2, "VALID"), ("avg", 2, 2, "VALID"), ("max", 3, 1, "SAME"),
         ("max", 3, 2, "SAME"), ("avg", 3, 1, "SAME")]  # fmt: skip


def _layer(kernel, dilation, lo, stride, layout):
    """A convolution along both spatial axes: at stride 1 with ``lo`` padding before and the
    rest of the window's reach after (as long as its input), else "SAME"."""
    reach = (kernel - 1) * dilation
    pad = ((lo, reach - lo),) * 2 if stride == 1 else "SAME"
    return lambda h, w: lax.conv_general_dilated(
        h, w, (stride, stride), pad, rhs_dilation=(dilation,) * 2, dimension_numbers=layout
    )


def _pool(h, pool, layout):
    """Max or average pooling over both spatial axes."""
    op, window, stride, padding = pool
    dims = (1, window, window, 1) if layout == "nhwc" else (1, 1, window, window)
    steps = (1, stride, stride, 1) if layout == "nhwc" else (1, 1, stride, stride)
    if op == "max":
        return lax.reduce_window(h, -jnp.inf, lax.max, dims, steps, padding)
    return lax.reduce_window(h, 0.0, lax.add, dims, steps, padding) / window**2


@st.composite
def _stacks(draw):
    """A random stack of convolutions (kernel 1-4, dilation 1-2, any split of the padding, a
    strided one now and then after the first), activations, residual adds and poolings over one
    image."""
    layout = draw(st.sampled_from(sorted(LAYOUTS)))
    depth = draw(st.integers(1, 4))
    channels = draw(st.integers(1, 3))
    layers = []
    for k in range(depth):
        kernel, dilation = draw(st.integers(1, 4)), draw(st.integers(1, 2))
        lo = draw(st.integers(0, (kernel - 1) * dilation))
        stride = draw(st.sampled_from([1, 1, 1, 2])) if k else 1  # the split's seed: stride 1
        act = draw(st.sampled_from(sorted(ACTIVATIONS)))
        pool = draw(st.sampled_from(POOLS))
        layers.append((kernel, dilation, lo, stride, act, draw(st.booleans()), pool))
    size = draw(st.sampled_from([2, 2, 2, 1])) * draw(st.integers(4, 10))
    bad = draw(st.sampled_from([None, np.nan, np.inf]))
    return layout, channels, layers, size, bad


def _program(layout, layers):
    """The stack as a function of (kernels, image)."""
    dn = LAYOUTS[layout]

    def fun(ws, x):
        h = x
        for w, (kernel, dilation, lo, stride, act, residual, pool) in zip(ws, layers):
            out = ACTIVATIONS[act](_layer(kernel, dilation, lo, stride, dn)(h, w))
            h = out + h if residual and out.shape == h.shape else out
            h = h if pool is None else _pool(h, pool, layout)
        return h

    return fun


def _inputs(layout, channels, layers, size, bad, seed):
    shape = (1, size, size, channels) if layout == "nhwc" else (1, channels, size, size)
    (x,) = _arrays(shape, seed=seed)
    if bad is not None:
        x = x.at[(0, size // 2, 1, 0) if layout == "nhwc" else (0, 0, size // 2, 1)].set(bad)
    kshape = (lambda k: (k, k, channels, channels)) if layout == "nhwc" else None
    kshape = kshape or (lambda k: (channels, channels, k, k))
    ws = _arrays(*(kshape(layer[0]) for layer in layers), seed=seed + 1)
    return [0.5 * w for w in ws], x


def _float64_of(fun):
    return lambda *args: _float64(fun, *args)


def _split_extended(fun, args, axis, chunk):
    """``fun`` with the result of its first convolution split along ``axis`` on extended
    chunks of ``chunk`` (at most the region's axis less one), evaluated (its results' leaves);
    and the region. Where nothing extends (1x1 kernels: a kernel gradient's taps reach no
    other position), the region is grown again on plain chunks, as the planner does: its
    kernel gradients' reducers read extended chunks only."""
    closed = inline_calls(jax.make_jaxpr(fun)(*args))
    leaves = jax.tree.leaves(args)
    graph = Graph(closed)
    seed = next(e.outvars[0] for e in graph.eqns if e.primitive.name == "conv_general_dilated")
    region = grow(graph, seed, axis, 1, 10**9, spanning=halo.EXTENDED)
    if region.span.plain:
        region = grow(graph, seed, axis, 1, 10**9)
    new = emit(closed, graph, strategy(graph, region), max(1, min(chunk, region.size - 1)))
    got = memsafe_jit(lambda *a: jax.core.eval_jaxpr(new.jaxpr, new.consts, *a))(*leaves)
    return got, region


@settings(
    max_examples=examples(40), phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]
)
@given(_stacks(), st.integers(1, 8), st.sampled_from(["rows", "loss", "grad"]), st.integers(0, 9))
@example(("nchw", 1, [(1, 1, 0, 1, "none", False, None)], 8, None), 1, "grad", 0)  # 1x1: E = 0
def test_random_conv_stacks_on_extended_chunks(stack, chunk, output, seed):
    """Any stack, any chunk; its value summed over channels (written chunk by chunk), a loss
    over it or its gradient: jax.jit's answers."""
    layout, channels, layers, size, bad = stack
    forward = _program(layout, layers)
    fun = {
        "rows": lambda ws, x: jnp.sum(forward(ws, x), 3 if layout == "nhwc" else 1),
        "loss": lambda ws, x: jnp.sum(forward(ws, x) ** 2),
        "grad": jax.grad(lambda ws, x: jnp.sum(jnp.sin(forward(ws, x))), argnums=(0, 1)),
    }[output]
    args = _inputs(layout, channels, layers, size, bad, seed)
    axis = 1 if layout == "nhwc" else 2
    try:
        got, region = _split_extended(fun, args, axis, chunk)
    except SplitFailure:  # a window that does not tile the axis reads its operand whole
        assert any(layer[3] > 1 or layer[6] for layer in layers)
        return
    want, wide = (jax.tree.leaves(f(*args)) for f in (memsafe_jit(fun), _float64_of(fun)))
    assert check(got, want, wide) == []
    reach = (layers[0][0] - 1) * layers[0][1]
    if reach:  # the first layer has a window along the axis (its result as long as the image)
        rows = size // region.size  # the image's positions per position of the region's axis
        assert region.span.extend >= -(-max(layers[0][2], reach - layers[0][2]) // rows)


def test_extension_adds_the_reaches_along_the_longest_chain():
    """Three 3x3 layers and a 5x5 one (reach 2): the loss needs 5 positions on each side. Its
    gradient runs the cotangent back through the input gradients of layers 4, 3 and 2 (the
    first layer's is not needed): 4 more. Each kernel gradient reads a window of its layer's
    input, which needs less."""
    layers = [(3, 1, 1, 1, "relu", False, None)] * 3 + [(5, 1, 2, 1, "relu", False, None)]
    forward = _program("nhwc", layers)
    args = _inputs("nhwc", 2, layers, 16, None, 0)
    loss = lambda ws, x: jnp.sum(forward(ws, x) ** 2)
    assert _split_extended(loss, args, 1, 4)[1].span.extend == 5
    assert _split_extended(jax.grad(loss), args, 1, 4)[1].span.extend == 9


def _deep_convs(ws, x):
    h = x
    for w in ws:
        h = jax.nn.relu(
            lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=LAYOUTS["nhwc"])
        )
    return jnp.sum(h**2)


def _deep_inputs():
    x, *ws = _arrays((1, 96, 96, 8), *[(3, 3, 8, 8)] * 4, seed=3)
    return [0.3 * w for w in ws], x


def test_four_conv_layers_on_one_image_fit_a_third():
    """Batch 1: the gradient of four 3x3 conv+ReLU layers runs in one loop over rows, the
    kernel gradients summed over chunks of extended rows; jax.jit's answers."""
    fun, args = jax.grad(_deep_convs), _deep_inputs()
    plan = _under_limit(fun, args, _a_third)
    assert [s.axis for s in plan.splits] in ([1], [2])
    assert "conv taps (halo)" in plan.splits[0].sinks


@pytest.fixture
def no_windows():
    """No primitive is windowed (``primitives.WINDOWED`` empty): no region on extended chunks."""
    windowed = sorted(primitives.WINDOWED)
    rows = {n: primitives.declare(n, Facts(Kind.OTHER)) for n in windowed}
    yield
    for n, row in rows.items():
        primitives.declare(n, row)


def test_without_halos_the_four_layers_are_refused(no_windows):
    """The same limit without extended chunks: each layer reads the one before whole."""
    fun, args = jax.grad(_deep_convs), _deep_inputs()
    with pytest.raises(memsafe.MemoryLimitError):
        memsafe.jit(fun, memory_limit=_a_third(fun, args)).plan(*args)


def _min_pools(x):
    h = x
    for _ in range(3):
        h = jnp.sin(lax.reduce_window(h, jnp.inf, lax.min, (1, 3, 3, 1), (1, 1, 1, 1), "SAME"))
    return jnp.sum(h, axis=(1, 2))


def test_min_pooling_layers_run_on_extended_chunks():
    """Three 3x3 min-poolings in a row over one image (every windowed primitive's rule maps its
    axis through as a Halo, min-pooling's too): one region on extended rows, jax.jit's
    answers, a NaN included."""
    (x,) = _arrays((1, 192, 192, 8), seed=5)
    x = x.at[0, 90, 3, 2].set(jnp.nan)
    plan = _under_limit(_min_pools, [x], _a_quarter_of_temps)
    assert [s.axis for s in plan.splits] in ([1], [2])
    assert plan.splits[0].extend == 3


def test_resnet_on_one_image_fits_a_third():
    """The ResNet-style gradient of tests/test_conv.py (stem, residual block, batch-norm with
    statistics over the image, max pooling) at batch 1: one region over rows crosses the
    pooling (its axis counts pooled rows, two image rows each), every batch-norm a stage;
    jax.jit's answers."""
    params, x, labels = _resnet_inputs(batch=1, size=128, channels=8)
    plan = _under_limit(jax.grad(_resnet_loss), [params, x, labels], _a_third)
    assert [s.axis for s in plan.splits] == [1]
    assert plan.splits[0].size == 64
    assert "conv taps (halo)" in plan.splits[0].sinks


def test_the_plan_shows_the_halos_and_their_cost():
    """plan() says how far chunks extend and counts the halos' work in the recompute cost."""
    fun, args = jax.grad(_deep_convs), _deep_inputs()
    plan = memsafe.jit(fun, memory_limit=_a_third(fun, args)).plan(*args)
    (split,) = plan.splits
    assert split.extend == 7  # 4 layers forward, 3 input gradients back
    assert split.recompute_flops > 0
    assert "each chunk extended by 7 on both sides" in split.describe()


def test_flax_cnn_on_one_image_fits_a_third():
    """A flax.linen CNN as users write it (Conv, ReLU, a max and an average pooling, a dense
    head, optax's cross-entropy), batch 1: its gradient runs in one region over pooled rows
    (the average pooling's gradient pads its cotangent: the pad is folded into the pooling)."""
    nn = pytest.importorskip("flax.linen")
    optax = pytest.importorskip("optax")

    class CNN(nn.Module):
        @nn.compact
        def __call__(self, x):
            for features in (16, 16, "max", 32, 32, "avg", 32):
                if features == "max":
                    x = nn.max_pool(x, (2, 2), (2, 2))
                elif features == "avg":
                    x = nn.avg_pool(x, (2, 2), (2, 2))
                else:
                    x = nn.relu(nn.Conv(features, (3, 3))(x))
            return nn.Dense(10)(jnp.mean(x, (1, 2)))

    model = CNN()
    (x,) = _arrays((1, 192, 192, 3), seed=9)
    params = model.init(jax.random.PRNGKey(0), x)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.apply(p, x), y).mean()

    plan = _under_limit(jax.grad(loss), [params, x, jnp.array([3])], _a_third)
    assert [s.axis for s in plan.splits] == [1] and plan.splits[0].extend > 0
    assert "pad_into_window" in {r.rule for r in plan.rules}


def _strided_convs(ws, x):
    """Two stride-2 convolutions between stride-1 ones: the gradient convolves the cotangent
    dilated by the stride (an lhs dilation) to reach each strided layer's input."""
    h = x
    for w, stride in zip(ws, (1, 2, 1, 2, 1)):
        h = jax.nn.relu(
            lax.conv_general_dilated(h, w, (stride,) * 2, "SAME", dimension_numbers=LAYOUTS["nhwc"])
        )
    return jnp.sum(h**2)


def test_strided_convolutions_and_their_gradients_share_one_region():
    """The region's axis counts the rows after both strides (a quarter of the image's)."""
    x, *ws = _arrays((1, 256, 256, 8), *[(3, 3, 8, 8)] * 5, seed=1)
    plan = _under_limit(jax.grad(_strided_convs), [[0.3 * w for w in ws], x], _a_third)
    assert [(s.axis, s.size) for s in plan.splits] == [(1, 64)]


@pytest.mark.parametrize(
    ("window", "stride", "padding"), [(2, 2, "VALID"), (3, 2, "SAME"), (3, 1, "SAME")]
)
def test_pad_into_window_keeps_the_average_pooling_gradient(window, stride, padding):
    """The rewrite folds the gradient's pad into its reduce_window_sum: the same values, and no
    pad left in the program."""
    from memsafe.rewrite.match import apply_rules
    from memsafe.rules import window as window_rule

    def pooled(x):
        dims, steps = (1, window, window, 1), (1, stride, stride, 1)
        return jnp.sum(jnp.sin(lax.reduce_window(x, 0.0, lax.add, dims, steps, padding)))

    (x,) = _arrays((2, 13, 12, 3), seed=4)
    grad = jax.grad(pooled)
    closed = inline_calls(jax.make_jaxpr(grad)(x))
    new, records = apply_rules(closed, [], rewrites=window_rule.REWRITES)
    assert [r.rule for r in records] == ["pad_into_window"]
    assert "pad" not in {e.primitive.name for e in new.jaxpr.eqns}
    got = memsafe_jit(lambda x: jax.core.eval_jaxpr(new.jaxpr, new.consts, x))(x)
    assert check(got, [memsafe_jit(grad)(x)], [_float64(grad, x)]) == []


def test_a_pad_with_another_value_stays():
    """Padding a max pooling's operand with zeros is not the pooling's own padding (-inf)."""
    from memsafe.rewrite.match import apply_rules
    from memsafe.rules import window as window_rule

    def fun(x):
        padded = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
        return lax.reduce_window(padded, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 1, 1, 1), "VALID")

    (x,) = _arrays((1, 8, 8, 2), seed=5)
    _, records = apply_rules(jax.make_jaxpr(fun)(x), [], rewrites=window_rule.REWRITES)
    assert records == []


def _unet(p, x, target):
    """A small U-Net as written for segmentation: two encoder convolutions, max pooling, two
    more, a transposed convolution back up, the skip connection concatenated along channels,
    a convolution and a 1x1 head, per-pixel squared loss."""

    def conv(h, w, transposed=False):
        if transposed:
            return jax.nn.relu(
                lax.conv_transpose(h, w, (2, 2), "SAME", dimension_numbers=LAYOUTS["nhwc"])
            )
        return jax.nn.relu(
            lax.conv_general_dilated(h, w, (1, 1), "SAME", dimension_numbers=LAYOUTS["nhwc"])
        )

    skip = conv(conv(x, p[0]), p[1])
    h = lax.reduce_window(skip, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    h = conv(conv(conv(h, p[2]), p[3]), p[4], transposed=True)
    h = conv(jnp.concatenate([h, skip], axis=-1), p[5])
    out = lax.conv_general_dilated(h, p[6], (1, 1), "SAME", dimension_numbers=LAYOUTS["nhwc"])
    return jnp.mean((out - target) ** 2)


def test_unet_on_one_image_fits_a_third():
    """Down and up again in one region: the transposed convolution's window over its dilated
    input, its kernel gradient (taps over the dilated input) and the concatenation of channels
    all run on extended chunks."""
    shapes = [(3, 3, 3, 16), (3, 3, 16, 16), (3, 3, 16, 32), (3, 3, 32, 32), (2, 2, 32, 16),
              (3, 3, 32, 16), (1, 1, 16, 1)]  # fmt: skip
    x, target, *p = _arrays((1, 256, 256, 3), (1, 256, 256, 1), *shapes, seed=2)
    plan = _under_limit(jax.grad(_unet), [[0.3 * w for w in p], x, target], _a_third)
    assert [(s.axis, s.size) for s in plan.splits] == [(1, 128)]
