"""``conv_general_dilated``: the axes a convolution maps, contracts, and reads in windows.

From the equation's ``dimension_numbers`` (``lhs_spec``: batch, feature, spatial...;
``rhs_spec``: output feature, input feature, spatial...; ``out_spec``: batch, feature,
spatial...):

- the batch axis passes from the input to the result (the kernel used whole);
- the kernel's output-feature axis passes to the result's feature axis (the input used whole);
- the input-feature axis is contracted: a sum sink over chunks of input and kernel features;
- a spatial axis of the result is computed chunk by chunk from its window of the whole input
  (:class:`memsafe.split.window.Window`: padding, strides and both dilations), so the input
  is used whole there, as the layout ops of ``prims/windows.py`` read theirs. A spatial axis whose
  window is one position wide (a 1x1 convolution, stride 1, no padding) passes like a batch axis;
- a spatial axis of the kernel is contracted: a sum sink over chunks of its taps
  (:class:`KernelTaps`), the input read whole. A spatial axis of the input is refused (its
  windows overlap: the result is split instead).

The gradients of a convolution are convolutions with other dimension numbers (the input's: the
cotangent dilated by the stride against the reversed kernel; the kernel's: input and cotangent
contracted over the batch axis), so the same rule splits them: a batch split of a training step
makes the kernel gradient a sum sink (gradient accumulation).

On extended chunks a spatial axis maps through as a halo instead: the halo strategy extends this
rule (``memsafe.split.strategies.halo.rules``). Chunk bodies bind convolutions in XLA's canonical
layout (:func:`bind`).

Grouped convolutions split along their batch (``batch_group_count == 1``) and spatial axes; along
their feature axes only over whole groups, on extended chunks (the halo strategy's ``Grouped``).
"""

from __future__ import annotations

from typing import Any

from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn_with
from memsafe.split import sinks
from memsafe.split.registry import Mapping, NoRule, RuleContext, Side, shape, split_rule
from memsafe.split.sinks import Sink
from memsafe.split.window import Window

NAME = "conv_general_dilated"


def specs(eqn: JaxprEqn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(lhs_spec, rhs_spec, out_spec): each operand's axes in the order of its roles."""
    dn = eqn.params["dimension_numbers"]
    return tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)


def window(eqn: JaxprEqn, k: int) -> Window:
    """The window of spatial dimension ``k`` (in the order of the specs)."""
    p = eqn.params
    size = shape(eqn.invars[1])[specs(eqn)[1][2 + k]]
    lo, hi = p["padding"][k]
    return Window(size, p["window_strides"][k], lo, hi, p["lhs_dilation"][k], p["rhs_dilation"][k])


def bind(eqn: JaxprEqn, invals: list[Any], **params: Any) -> list[Any]:
    """The equation on ``invals`` (``params`` replaced), its operands transposed to XLA's
    canonical layout (input: batch, spatial, feature; kernel: spatial, input and output
    feature) and its result transposed back. Inside a loop XLA's CPU backend runs a
    convolution in another layout (a kernel gradient's) about 20x slower than at the top level
    (4 chunks of a 256x256x32 image's 3x3 kernel gradient: 0.40 s against 0.018 s); in the
    canonical layout, as fast."""
    lhs_spec, rhs_spec, out_spec = specs(eqn)
    nd = len(lhs_spec) - 2
    lhs = _transposed(invals[0], (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
    rhs = _transposed(invals[1], (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
    canon = (0, nd + 1, *range(1, nd + 1))
    dn = lax.ConvDimensionNumbers(canon, (nd + 1, nd, *range(nd)), canon)
    (out,) = bind_eqn_with(eqn, [lhs, rhs], **params, dimension_numbers=dn)
    roles = (out_spec[0], *out_spec[2:], out_spec[1])  # the result's axes, canonical order
    return [_transposed(out, tuple(roles.index(a) for a in range(nd + 2)))]


def _transposed(x: Any, perm: tuple[int, ...]) -> Any:
    return x if perm == tuple(range(len(perm))) else lax.transpose(x, perm)


def require_ungrouped(eqn: JaxprEqn, what: str, *counts: str) -> None:
    for count in counts:
        if eqn.params[count] != 1:
            raise NoRule(f"{NAME} with {count}={eqn.params[count]} along its {what} axis")


def _batch(eqn: JaxprEqn) -> Mapping:
    require_ungrouped(eqn, "batch", "batch_group_count")
    lhs, _, out = specs(eqn)
    return Mapping(ins=(lhs[0], None), outs=(out[0],))


def _out_feature(eqn: JaxprEqn) -> Mapping:
    require_ungrouped(eqn, "output-feature", "feature_group_count", "batch_group_count")
    _, rhs, out = specs(eqn)
    return Mapping(ins=(None, rhs[0]), outs=(out[1],))


def _contracting(eqn: JaxprEqn) -> Sink:
    require_ungrouped(eqn, "input-feature", "feature_group_count")
    lhs, rhs, _ = specs(eqn)
    return Sink(sinks.DOT, ins=(lhs[1], rhs[1]))


def taps_window(eqn: JaxprEqn, k: int) -> Window:
    """The window of taps over every output along spatial dimension ``k`` of a kernel gradient
    (the cotangent as the kernel): output position ``o`` and tap ``j`` read padded input
    position ``o * stride + j * rhs_dilation``, so the roles of outputs and taps swap."""
    w = window(eqn, k)
    outputs = shape(eqn.outvars[0])[specs(eqn)[2][2 + k]]
    return Window(outputs, w.window_dilation, w.pad_lo, w.pad_hi, w.base_dilation, w.stride)


class KernelTaps(sinks.Monoid):
    """A kernel's spatial axis in chunks of taps: each chunk's taps convolved with the window of
    the whole input they read (a shift of ``start * rhs_dilation`` padded positions), summed.

    Output position ``o`` and tap ``j`` read padded input position ``o * stride + j *
    rhs_dilation``: the roles of outputs and taps swap, so the window of taps ``[start, start +
    n)`` over all ``O`` outputs is a :class:`Window` of size ``O`` with stride ``rhs_dilation``
    and dilation ``stride``. This is the kernel gradient's convolution split along the spatial
    axis of its cotangent."""

    def __init__(self) -> None:
        super().__init__("conv taps", lax.add, rescalable=True)

    def partial(self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int):
        lhs_spec, rhs_spec, _ = specs(eqn)
        k = rhs_spec.index(axis) - 2
        taps = taps_window(eqn, k)
        lhs = taps.read(invals[0], lhs_spec[2 + k], start, size, 0)
        return tuple(bind(eqn, [lhs, invals[1]], **unpadded(eqn, k)))


TAPS = KernelTaps()


def unpadded(eqn: JaxprEqn, k: int) -> dict[str, Any]:
    """Padding and lhs dilation params with spatial dimension ``k`` read as it is (its window
    already taken)."""
    padding, dilation = list(eqn.params["padding"]), list(eqn.params["lhs_dilation"])
    padding[k], dilation[k] = (0, 0), 1
    return {"padding": tuple(padding), "lhs_dilation": tuple(dilation)}


def _spatial(eqn: JaxprEqn, side: Side, k: int, ctx: RuleContext) -> Mapping | Sink:
    lhs, _, out = specs(eqn)
    if side == ("in", 1):
        return Sink(TAPS, ins=(None, specs(eqn)[1][2 + k]))
    if window(eqn, k).trivial:
        return Mapping(ins=(lhs[2 + k], None), outs=(out[2 + k],))
    if side[0] == "out":
        return Mapping(ins=(None, None), outs=(out[2 + k],))  # windows of the whole input
    raise NoRule(f"{NAME} reads overlapping windows of the split axis (split its result)")


def _conv_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping | Sink:
    """Where the split axis goes through a convolution (see the module's docstring)."""
    spec = specs(eqn)[1 if side == ("in", 1) else 0 if side[0] == "in" else 2]
    role = spec.index(axis)
    if role >= 2:
        return _spatial(eqn, side, role - 2, ctx)
    if side == ("in", 1):
        return _out_feature(eqn) if role == 0 else _contracting(eqn)
    if side[0] == "out" and role == 1:
        return _out_feature(eqn)
    return _batch(eqn) if role == 0 else _contracting(eqn)


def _rebind_conv(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """Chunks of batch and features: the same convolution. A chunk of a spatial axis of the
    result: the convolution of its window of the input, unpadded and undilated along the axis."""
    if m.ins != (None, None):
        return bind(eqn, invals)
    lhs_spec, _, out_spec = specs(eqn)
    k = out_spec.index(m.outs[0]) - 2
    lhs = window(eqn, k).read(invals[0], lhs_spec[2 + k], start, n, 0)
    return bind(eqn, [lhs, invals[1]], **unpadded(eqn, k))


split_rule(NAME, rebind=_rebind_conv, positional=lambda eqn, m: m.ins != (None, None))(_conv_map)
