"""The halo strategy's extensions of the windowed primitives' split rules
(``memsafe.split.registry.Extension``): what convolutions and poolings do on extended chunks.

While a region grows on extended chunks (``RuleContext.extended``):

- a spatial axis of a convolution whose input is ``stride / lhs_dilation`` times as long as its
  result (one of them 1: a "SAME" convolution, a strided one, the input gradient of a strided one)
  maps through as a :class:`~memsafe.split.strategies.halo.Halo`: the chunk's input, extended, is
  filled with zeros outside the axis and convolved unchanged, so several convolutions in a row run
  in one loop. The kernel gradient of such a convolution (input and cotangent both split along the
  axis) is a sum sink over the cotangent's chunks, each against the window of the extended input
  it reads (:class:`HaloTaps`);
- a pooled axis whose operand is ``stride`` times as long as its result maps through as a halo
  (the operand filled with the padding value outside the axis), and so does the gradient of a max
  pooling whose windows tile the axis (:class:`Tiled`): a stack of convolutions and poolings runs
  in one region;
- a reshape that merges the split axis with the axes after it, or splits it into an axis and the
  axes after it (:class:`Regrouped`: a ``jax.vmap`` of a convolutional network folds its batch
  into the convolutions' batch axis and unfolds it after), maps the axis through: values of
  several lengths join the region, which runs over whole groups;
- a grouped convolution maps its groups through (:class:`Grouped`: the input's features, the
  kernel's output features and the result's features, each over whole groups): ``jax.vmap`` of
  an ensemble with its own kernels, and per-example kernel gradients.

Elsewhere the primitives' own rules (``memsafe.split.prims.conv``, ``.pool``) answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn, bind_eqn_with
from memsafe.split import sinks
from memsafe.split.prims import conv, pool
from memsafe.split.registry import (
    Extension,
    Mapping,
    RuleContext,
    Side,
    bind_unchanged,
    extend,
    shape,
)
from memsafe.split.sinks import Sink
from memsafe.split.strategies.halo.extended import Halo, centre, fill_outside
from memsafe.split.window import Window, aligned

# -- convolutions ------------------------------------------------------------------------------


class HaloTaps(sinks.Monoid):
    """A kernel gradient's spatial axis on extended chunks: each chunk of the cotangent's
    positions (its centre) against the window of the extended input its taps read, the input
    filled with zeros outside the axis; summed over chunks (see
    ``memsafe.split.prims.conv.KernelTaps``)."""

    def __init__(self) -> None:
        super().__init__("conv taps (halo)", lax.add, rescalable=True)

    def _taps(self, eqn: JaxprEqn, axis: int) -> tuple[int, Window]:
        """(spatial dimension, the window of taps over every output) of the sink along
        ``axis`` of the input: cotangent position ``c`` and tap ``j`` read position ``c *
        window_dilation + j * stride - pad_lo`` of the input dilated by the lhs dilation."""
        k = conv.specs(eqn)[0].index(axis) - 2
        return k, conv.taps_window(eqn, k)

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
        x = fill_outside(x, ins[0], (start - extend) * sx, n, 0)
        ct = centre(ct, ins[1], extend * sc, size * sc)
        lhs = taps.read(x, ins[0], extend * sc, size * sc, 0)
        return tuple(conv.bind(eqn, [lhs, ct], **conv.unpadded(eqn, k)))

    def partial(self, eqn: JaxprEqn, invals: list[Any], axis: int, start: Any, size: int):
        raise NotImplementedError("HaloTaps runs on extended chunks only")


HALO_TAPS = HaloTaps()


def _windowed(eqn: JaxprEqn, k: int) -> Halo | None:
    """Spatial dimension ``k`` as a :class:`Halo` where output ``o`` reads positions around ``o
    * stride`` of the input dilated by the lhs dilation (the input gradient of a strided
    convolution), one of them 1, and the lengths match them exactly; else None."""
    lhs, _, out = conv.specs(eqn)
    w = conv.window(eqn, k)
    n_in, n_out = shape(eqn.invars[0])[lhs[2 + k]], shape(eqn.outvars[0])[out[2 + k]]
    if not aligned(w.stride, w.base_dilation, n_in, n_out):
        return None
    return Halo.over(w, (lhs[2 + k], None), (out[2 + k],))


def _taps_along(eqn: JaxprEqn, k: int) -> Sink | None:
    """Spatial dimension ``k`` of a kernel gradient (the cotangent as the kernel, one tap per
    output position) as a :class:`HaloTaps` sink where consecutive cotangent positions read
    positions ``window_dilation`` apart of the input dilated by the lhs dilation (one of them
    1), and the lengths match them exactly; else None."""
    lhs, rhs, _ = conv.specs(eqn)
    w = conv.window(eqn, k)
    n_in, n_taps = shape(eqn.invars[0])[lhs[2 + k]], shape(eqn.invars[1])[rhs[2 + k]]
    if not aligned(w.window_dilation, w.base_dilation, n_in, n_taps):
        return None
    conv.require_ungrouped(eqn, "spatial", "feature_group_count", "batch_group_count")
    return Sink(HALO_TAPS, ins=(lhs[2 + k], rhs[2 + k]))


def _conv_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Halo | Sink | None:
    """A spatial axis on extended chunks, where it maps through as a halo or its taps sum."""
    if not ctx.extended:
        return None
    spec = conv.specs(eqn)[1 if side == ("in", 1) else 0 if side[0] == "in" else 2]
    k = spec.index(axis) - 2
    if k < 0:
        return None
    if side == ("in", 1):
        return _taps_along(eqn, k)
    return _windowed(eqn, k) or (_taps_along(eqn, k) if side == ("in", 0) else None)


def _rebind_conv(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """An extended chunk: zeros outside the axis, then the convolution as it is."""
    assert isinstance(m, Halo)
    n_in = shape(eqn.invars[0])[m.ins[0]]
    x = fill_outside(invals[0], m.ins[0], m.operand_start(start), n_in, 0)
    return conv.bind(eqn, [x, invals[1]])


extend(conv.NAME, extension=Extension(_conv_map, Halo, _rebind_conv))


# -- poolings ----------------------------------------------------------------------------------


def _reduce_window_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Halo | None:
    """A pooled axis on extended chunks whose operand is ``stride`` times as long as its
    result."""
    win = pool.window(eqn, axis)
    if not ctx.extended or win.trivial:
        return None
    n_in, n_out = shape(eqn.invars[0])[axis], shape(eqn.outvars[0])[axis]
    if not aligned(win.stride, win.base_dilation, n_in, n_out):
        return None
    k, inits = pool.operands(eqn), len(eqn.invars) - pool.operands(eqn)
    return Halo.over(win, (axis,) * k + (None,) * inits, tuple(axis for _ in eqn.outvars))


def _rebind_reduce_window(eqn: JaxprEqn, invals: list, m: Mapping, start: Any, n: int) -> list:
    """An extended chunk: the padding value outside the axis, then the reduction as it is."""
    assert isinstance(m, Halo)
    axis, k = m.outs[0], pool.operands(eqn)
    n_in = shape(eqn.invars[0])[axis]
    first = m.operand_start(start)
    fills = pool.fills(eqn, invals)
    filled = [fill_outside(x, axis, first, n_in, f) for x, f in zip(invals, fills)]
    return bind_eqn(eqn, filled + invals[k:])


extend(
    *pool.REDUCE_WINDOWS,
    extension=Extension(_reduce_window_map, Halo, _rebind_reduce_window),
)


@dataclass(frozen=True)
class Tiled(Halo):
    """``select_and_scatter_add`` on extended chunks along an axis its windows tile (as long as
    their stride, no padding): each window's cotangent lands in the window, so a chunk's result
    is the equation on its chunks, the source ``stride`` times shorter than the operand."""

    def lengths_agree(self, ins: Sequence[int | None], outs: Sequence[int | None]) -> bool:
        source, operand = ins
        scaled = None if source is None else source * self.stride
        return len({n for n in (scaled, operand, *outs) if n is not None}) <= 1

    def wrong_after(self, ins: Sequence[int | None]) -> int:
        """A wrong source position spoils its window's ``stride`` result positions."""
        source, operand = ins
        return max(self.stride * (source or 0), operand or 0)


def _select_and_scatter_add_map(
    eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext
) -> Tiled | None:
    """An axis the windows tile, on extended chunks."""
    win = pool.window(eqn, axis)
    if not ctx.extended or win.trivial:
        return None
    tiles = win.size == win.stride and (win.pad_lo, win.pad_hi) == (0, 0)
    if tiles and win.base_dilation == win.window_dilation == 1:
        return Tiled.over(win, (axis, axis), (axis,))
    return None


extend(
    "select_and_scatter_add",
    extension=Extension(_select_and_scatter_add_map, Tiled, bind_unchanged),
)


# -- reshapes ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Regrouped(Halo):
    """A reshape that merges the split axis with the axes after it (the operand ``dilation``
    times shorter along it than the result: a ``jax.vmap`` over a batch folded into a
    convolution's batch axis) or splits it into an axis and the axes after it (``stride`` times
    longer): position ``i`` of the shorter is positions ``[k * i, k * (i + 1))`` of the longer.
    The region's axis runs over the shorter, so a chunk is whole groups of the longer."""


def _regroup(src: Sequence[int], axis: int, dst: Sequence[int]) -> int | None:
    """The axis ``k`` of shape ``dst`` that, with the axes after it, regroups axis ``axis`` of
    shape ``src`` and the axes after it: ``dst[k]`` merges ``src[axis:j]``, or ``src[axis]``
    splits into ``dst[k:j]`` (more than one position per group); None where neither."""
    before = math.prod(src[:axis])
    for k in range(len(dst)):
        if math.prod(dst[:k]) != before:
            continue
        for j in range(axis + 2, len(src) + 1):
            if dst[k] == math.prod(src[axis:j]) and math.prod(src[axis + 1 : j]) > 1:
                return k
        for j in range(k + 2, len(dst) + 1):
            if src[axis] == math.prod(dst[k:j]) and math.prod(dst[k + 1 : j]) > 1:
                return k
    return None


def _reshape_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Regrouped | None:
    """The split axis merged with the axes after it, or split into an axis and those after it,
    on extended chunks (where values of several lengths along the axis join one region). A
    reshape's ``dimensions`` (the operand transposed first, as ``jax.vmap`` of a convolution
    moves the batch next to the convolution's own) are looked through."""
    if not ctx.extended or len(eqn.invars) != 1:
        return None
    ins, outs = shape(eqn.invars[0]), shape(eqn.outvars[0])
    perm = tuple(eqn.params.get("dimensions") or range(len(ins)))
    moved = tuple(ins[d] for d in perm)  # the operand as the reshape reads it
    if side[0] == "in":
        k = _regroup(moved, perm.index(axis), outs)
        a_in, a_out = axis, k
    else:
        k = _regroup(outs, axis, moved)
        a_in, a_out = (None if k is None else perm[k]), axis
    if a_in is None or a_out is None:
        return None
    n_in, n_out = ins[a_in], outs[a_out]
    if n_in < n_out:  # merges: the operand is shorter
        return Regrouped((a_in,), (a_out,), dilation=n_out // n_in)
    return Regrouped((a_in,), (a_out,), stride=n_in // n_out)


def _rebind_regrouped(eqn: JaxprEqn, invals: list, m: Mapping, start: Any, n: int) -> list:
    """The reshape on the chunk: the result's axis as many groups long as the operand's chunk."""
    assert isinstance(m, Regrouped)
    (x,), (a_in,), (a_out,) = invals, m.ins, m.outs
    length = x.shape[a_in] * m.dilation // m.stride
    sizes = list(eqn.params["new_sizes"])
    sizes[a_out] = length
    return bind_eqn_with(eqn, invals, new_sizes=tuple(sizes))


extend("reshape", extension=Extension(_reshape_map, Regrouped, _rebind_regrouped, fallback=True))


# -- grouped convolutions ------------------------------------------------------------------------


@dataclass(frozen=True)
class Grouped(Halo):
    """A convolution with ``feature_group_count`` groups split along its groups: the input's
    feature axis (``groups`` x its features per group), the kernel's output-feature axis and the
    result's feature axis (``groups`` x the outputs per group) each run over whole groups, a
    chunk of groups being the convolution of those groups alone. ``jax.vmap`` makes such a
    convolution of one whose kernel is batched (an ensemble), and of the kernel gradient of
    one whose input is (the batch folded into the feature axis)."""

    groups: int = 1
    #: Input features per group, and kernel output features (result features) per group.
    per_in: int = 1
    per_out: int = 1

    def lengths_agree(self, ins: Sequence[int | None], outs: Sequence[int | None]) -> bool:
        return all(n is not None and n % self.groups == 0 for n in (*ins, *outs))

    def wrong_after(self, ins: Sequence[int | None]) -> int:
        """A group with a wrong input or kernel position is wrong in all its results."""
        w_in, w_kernel = ins
        groups = max(-(-(w_in or 0) // self.per_in), -(-(w_kernel or 0) // self.per_out))
        return groups * self.per_out

    def whole_units(self, eqn: JaxprEqn, size: int) -> bool:
        return self.groups % size == 0  # a chunk of the axis is whole groups


def _grouped_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Grouped | None:
    """The groups of a grouped convolution on extended chunks (where values of several lengths
    along the axis join one region)."""
    groups = eqn.params["feature_group_count"]
    if not ctx.extended or groups == 1 or eqn.params["batch_group_count"] != 1:
        return None
    lhs, rhs, out = conv.specs(eqn)
    along = {("in", 0): lhs[1], ("in", 1): rhs[0], ("out", 0): out[1]}.get(side)
    if along != axis:
        return None
    per_in = shape(eqn.invars[0])[lhs[1]] // groups
    per_out = shape(eqn.outvars[0])[out[1]] // groups
    return Grouped((lhs[1], rhs[0]), (out[1],), groups=groups, per_in=per_in, per_out=per_out)


def _rebind_grouped(eqn: JaxprEqn, invals: list, m: Mapping, start: Any, n: int) -> list:
    """The convolution of the chunk's groups alone."""
    assert isinstance(m, Grouped)
    return conv.bind(eqn, invals, feature_group_count=invals[0].shape[m.ins[0]] // m.per_in)


extend(conv.NAME, extension=Extension(_grouped_map, Grouped, _rebind_grouped, fallback=True))
