"""``conv_general_dilated``: the axes a convolution maps, contracts, and reads in windows.

From the equation's ``dimension_numbers`` (``lhs_spec``: batch, feature, spatial...;
``rhs_spec``: output feature, input feature, spatial...; ``out_spec``: batch, feature,
spatial...):

- the batch axis passes from the input to the result (the kernel used whole);
- the kernel's output-feature axis passes to the result's feature axis (the input used whole);
- the input-feature axis is contracted: a sum sink over chunks of input and kernel features;
- a spatial axis of the result is computed chunk by chunk from its window of the whole input
  (:class:`memsafe.split.strategies.halo.Window`: padding, strides and both dilations), so the input
  is used whole there, as the layout ops of ``prims/windows.py`` read theirs. A spatial axis whose
  window is one position wide (a 1x1 convolution, stride 1, no padding) passes like a batch axis;
- a spatial axis of the kernel is contracted: a sum sink over chunks of its taps
  (:class:`KernelTaps`), the input read whole. A spatial axis of the input is refused (its
  windows overlap: the result is split instead).

The gradients of a convolution are convolutions with other dimension numbers (the input's: the
cotangent dilated by the stride against the reversed kernel; the kernel's: input and cotangent
contracted over the batch axis), so the same rule splits them: a batch split of a training step
makes the kernel gradient a sum sink (gradient accumulation).

While regions grow on extended chunks (``RuleContext.extended``,
:mod:`memsafe.split.strategies.halo`), a spatial axis whose input is ``stride / lhs_dilation`` times
as long as its result (one of them 1: a "SAME" convolution, a strided one, the input gradient of a
strided one) maps through as a :class:`~memsafe.split.strategies.halo.Halo`: the chunk's input,
extended, is filled with zeros outside the axis and convolved unchanged, so several convolutions in
a row run in one loop. The kernel gradient of such a convolution (input and cotangent both split
along the axis) is a sum sink over the cotangent's chunks, each against the window of the extended
input it reads (:class:`HaloTaps`). Chunk bodies bind convolutions in XLA's canonical layout
(:func:`_bind`).

Grouped convolutions split along their batch (``batch_group_count == 1``) and spatial axes; the
feature axes of grouped convolutions are refused.
"""

from __future__ import annotations

from typing import Any

from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn_with
from memsafe.split import sinks
from memsafe.split.registry import Mapping, NoRule, RuleContext, Side, shape, split_rule
from memsafe.split.sinks import Sink
from memsafe.split.strategies import halo
from memsafe.split.strategies.halo import Halo, Window

_NAME = "conv_general_dilated"


def _specs(eqn: JaxprEqn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(lhs_spec, rhs_spec, out_spec): each operand's axes in the order of its roles."""
    dn = eqn.params["dimension_numbers"]
    return tuple(dn.lhs_spec), tuple(dn.rhs_spec), tuple(dn.out_spec)


def window(eqn: JaxprEqn, k: int) -> Window:
    """The window of spatial dimension ``k`` (in the order of the specs)."""
    p = eqn.params
    size = shape(eqn.invars[1])[_specs(eqn)[1][2 + k]]
    lo, hi = p["padding"][k]
    return Window(size, p["window_strides"][k], lo, hi, p["lhs_dilation"][k], p["rhs_dilation"][k])


def _bind(eqn: JaxprEqn, invals: list[Any], **params: Any) -> list[Any]:
    """The equation on ``invals`` (``params`` replaced), its operands transposed to XLA's
    canonical layout (input: batch, spatial, feature; kernel: spatial, input and output
    feature) and its result transposed back. Inside a loop XLA's CPU backend runs a
    convolution in another layout (a kernel gradient's) about 20x slower than at the top level
    (4 chunks of a 256x256x32 image's 3x3 kernel gradient: 0.40 s against 0.018 s); in the
    canonical layout, as fast."""
    lhs_spec, rhs_spec, out_spec = _specs(eqn)
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


def _require_ungrouped(eqn: JaxprEqn, what: str, *counts: str) -> None:
    for count in counts:
        if eqn.params[count] != 1:
            raise NoRule(f"{_NAME} with {count}={eqn.params[count]} along its {what} axis")


def _batch(eqn: JaxprEqn) -> Mapping:
    _require_ungrouped(eqn, "batch", "batch_group_count")
    lhs, _, out = _specs(eqn)
    return Mapping(ins=(lhs[0], None), outs=(out[0],))


def _out_feature(eqn: JaxprEqn) -> Mapping:
    _require_ungrouped(eqn, "output-feature", "feature_group_count", "batch_group_count")
    _, rhs, out = _specs(eqn)
    return Mapping(ins=(None, rhs[0]), outs=(out[1],))


def _contracting(eqn: JaxprEqn) -> Sink:
    _require_ungrouped(eqn, "input-feature", "feature_group_count")
    lhs, rhs, _ = _specs(eqn)
    return Sink(sinks.DOT, ins=(lhs[1], rhs[1]))


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
        lhs_spec, rhs_spec, out_spec = _specs(eqn)
        k = rhs_spec.index(axis) - 2
        w = window(eqn, k)
        outputs = shape(eqn.outvars[0])[out_spec[2 + k]]
        taps = Window(outputs, w.window_dilation, w.pad_lo, w.pad_hi, w.base_dilation, w.stride)
        lhs = taps.read(invals[0], lhs_spec[2 + k], start, size, 0)
        return tuple(_bind(eqn, [lhs, invals[1]], **_unpadded(eqn, k)))


TAPS = KernelTaps()


class HaloTaps(sinks.Monoid):
    """A kernel gradient's spatial axis on extended chunks: each chunk of the cotangent's
    positions (its centre) against the window of the extended input its taps read, the input
    filled with zeros outside the axis; summed over chunks (see :class:`KernelTaps`)."""

    def __init__(self) -> None:
        super().__init__("conv taps (halo)", lax.add, rescalable=True)

    def _taps(self, eqn: JaxprEqn, axis: int) -> tuple[int, Window]:
        """(spatial dimension, the window of taps over every output) of the sink along
        ``axis`` of the input: cotangent position ``c`` and tap ``j`` read position ``c *
        window_dilation + j * stride - pad_lo`` of the input dilated by the lhs dilation."""
        lhs_spec, _, out_spec = _specs(eqn)
        k = lhs_spec.index(axis) - 2
        w = window(eqn, k)
        outputs = shape(eqn.outvars[0])[out_spec[2 + k]]
        return k, Window(outputs, w.window_dilation, w.pad_lo, w.pad_hi, w.base_dilation, w.stride)

    def halo_reach(self, eqn: JaxprEqn, ins: tuple[int | None, ...]) -> dict[int, int]:
        _, taps = self._taps(eqn, ins[0])
        return {0: -(-taps.reach // taps.base_dilation)}  # in positions of the input

    def extended_partial(
        self,
        eqn: JaxprEqn,
        invals: list[Any],
        ins: tuple,
        scales: tuple[int, ...],
        start: Any,
        size: int,
        extend: int,
    ) -> tuple[Any, ...]:
        (x, ct), (sx, sc) = invals, scales
        k, taps = self._taps(eqn, ins[0])
        n = shape(eqn.invars[0])[ins[0]]
        x = halo.fill_outside(x, ins[0], (start - extend) * sx, n, 0)
        ct = halo.centre(ct, ins[1], extend * sc, size * sc)
        lhs = taps.read(x, ins[0], extend * sc, size * sc, 0)
        return tuple(_bind(eqn, [lhs, ct], **_unpadded(eqn, k)))

    def partial(self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int):
        raise NotImplementedError("HaloTaps runs on extended chunks only")


HALO_TAPS = HaloTaps()


def _unpadded(eqn: JaxprEqn, k: int) -> dict[str, Any]:
    """Padding and lhs dilation params with spatial dimension ``k`` read as it is (its window
    already taken)."""
    padding, dilation = list(eqn.params["padding"]), list(eqn.params["lhs_dilation"])
    padding[k], dilation[k] = (0, 0), 1
    return {"padding": tuple(padding), "lhs_dilation": tuple(dilation)}


def _windowed(eqn: JaxprEqn, k: int) -> Halo | None:
    """Spatial dimension ``k`` as a :class:`Halo` where output ``o`` reads positions around ``o
    * stride`` of the input dilated by the lhs dilation (the input gradient of a strided
    convolution), one of them 1, and the lengths match them exactly; else None."""
    lhs, _, out = _specs(eqn)
    w = window(eqn, k)
    n_in, n_out = shape(eqn.invars[0])[lhs[2 + k]], shape(eqn.outvars[0])[out[2 + k]]
    if not halo.aligned(w.stride, w.base_dilation, n_in, n_out):
        return None
    return Halo.over(w, (lhs[2 + k], None), (out[2 + k],))


def _taps_along(eqn: JaxprEqn, k: int) -> Sink | None:
    """Spatial dimension ``k`` of a kernel gradient (the cotangent as the kernel, one tap per
    output position) as a :class:`HaloTaps` sink where consecutive cotangent positions read
    positions ``window_dilation`` apart of the input dilated by the lhs dilation (one of them
    1), and the lengths match them exactly; else None."""
    lhs, rhs, _ = _specs(eqn)
    w = window(eqn, k)
    n_in, n_taps = shape(eqn.invars[0])[lhs[2 + k]], shape(eqn.invars[1])[rhs[2 + k]]
    if not halo.aligned(w.window_dilation, w.base_dilation, n_in, n_taps):
        return None
    _require_ungrouped(eqn, "spatial", "feature_group_count", "batch_group_count")
    return Sink(HALO_TAPS, ins=(lhs[2 + k], rhs[2 + k]))


def _extended(eqn: JaxprEqn, side: Side, k: int) -> Mapping | Sink | None:
    """The mapping of spatial dimension ``k`` on extended chunks, where one applies."""
    if side == ("in", 1):
        return _taps_along(eqn, k)
    return _windowed(eqn, k) or (_taps_along(eqn, k) if side == ("in", 0) else None)


def _spatial(eqn: JaxprEqn, side: Side, k: int, ctx: RuleContext) -> Mapping | Sink:
    lhs, _, out = _specs(eqn)
    if ctx.extended and (extended := _extended(eqn, side, k)) is not None:
        return extended
    if side == ("in", 1):
        return Sink(TAPS, ins=(None, _specs(eqn)[1][2 + k]))
    if window(eqn, k).trivial:
        return Mapping(ins=(lhs[2 + k], None), outs=(out[2 + k],))
    if side[0] == "out":
        return Mapping(ins=(None, None), outs=(out[2 + k],))  # windows of the whole input
    raise NoRule(f"{_NAME} reads overlapping windows of the split axis (split its result)")


def _conv_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping | Sink:
    """Where the split axis goes through a convolution (see the module's docstring)."""
    spec = _specs(eqn)[1 if side == ("in", 1) else 0 if side[0] == "in" else 2]
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
    if isinstance(m, Halo):  # an extended chunk: zeros outside the axis, then as it is
        n_in = shape(eqn.invars[0])[m.ins[0]]
        x = halo.fill_outside(invals[0], m.ins[0], m.operand_start(start), n_in, 0)
        return _bind(eqn, [x, invals[1]])
    if m.ins != (None, None):
        return _bind(eqn, invals)
    lhs_spec, _, out_spec = _specs(eqn)
    k = out_spec.index(m.outs[0]) - 2
    lhs = window(eqn, k).read(invals[0], lhs_spec[2 + k], start, n, 0)
    return _bind(eqn, [lhs, invals[1]], **_unpadded(eqn, k))


split_rule(_NAME, rebind=_rebind_conv, positional=lambda eqn, m: m.ins != (None, None))(_conv_map)
