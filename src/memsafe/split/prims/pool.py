"""Pooling: ``reduce_window`` (max, min, sum and the general form), the gradient of max
pooling, ``select_and_scatter_add``, and its forward-mode derivative, ``select_and_gather_add``.

An axis whose window is one position wide (the batch and channel axes of a pooling) passes
unchanged. Along a pooled axis, a chunk of the result is computed from its window of the whole
operand (:class:`memsafe.split.window.Window`), padding and base dilation filled with the
value the reduction pads with, so the operand is used whole there, as the layout ops of
``prims/windows.py`` read theirs. The gradient of average pooling is a ``pad`` and a
``reduce_window_sum``, both covered.

On extended chunks a pooled axis maps through as a halo instead, and so does the gradient of a
max pooling whose windows tile the axis: the halo strategy extends these rules
(``memsafe.split.strategies.halo.rules``).

``select_and_scatter_add`` routes each window's cotangent to the position its selection picks;
a chunk of its result reads the windows that overlap it, cotangent and operand. Along a padded
axis it is refused: which padding position a backend's selection may pick differs (the CPU
compares padding as a value), so no chunked form is sure to agree.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from memsafe._jax import JaxprEqn, bind_eqn, bind_eqn_with
from memsafe.split.registry import Mapping, NoRule, RuleContext, Side, split_rule
from memsafe.split.sinks import extreme_identity
from memsafe.split.window import Window, take


def window(eqn: JaxprEqn, axis: int) -> Window:
    """The window of the equation along ``axis`` of its operand."""
    p = eqn.params
    lo, hi = p["padding"][axis]
    base = p.get("base_dilation", (1,) * len(p["padding"]))[axis]
    dilation = p.get("window_dilation", (1,) * len(p["padding"]))[axis]
    return Window(p["window_dimensions"][axis], p["window_strides"][axis], lo, hi, base, dilation)


def _identity(name: str, dtype: Any) -> Any:
    """The value ``reduce_window_<name>`` pads with (the identity of its monoid)."""
    if name == "sum":
        return np.zeros((), dtype)
    return extreme_identity(name, dtype)


def operands(eqn: JaxprEqn) -> int:
    """Array operands of the reduction (the general form ends with one init value for each)."""
    return len(eqn.invars) // 2 if eqn.primitive.name == "reduce_window" else len(eqn.invars)


def _reduce_window_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    k, inits = operands(eqn), len(eqn.invars) - operands(eqn)
    outs = tuple(axis for _ in eqn.outvars)
    win = window(eqn, axis)
    if win.trivial:
        return Mapping(ins=(axis,) * k + (None,) * inits, outs=outs)
    if side[0] == "out":
        return Mapping(ins=(None,) * len(eqn.invars), outs=outs)  # windows of the whole operand
    raise NoRule(f"{eqn.primitive.name} reads overlapping windows of the split axis")


def fills(eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
    """The values the reduction pads its operands with, one for each."""
    k = operands(eqn)
    if eqn.primitive.name == "reduce_window":
        return invals[k:]
    name = eqn.primitive.name.removeprefix("reduce_window_")
    return [_identity(name, eqn.invars[0].aval.dtype)]


def unpadded(eqn: JaxprEqn, axis: int) -> dict[str, Any]:
    """The equation's padding (and base dilation) params with ``axis`` left unpadded."""
    padding = list(eqn.params["padding"])
    padding[axis] = (0, 0)
    params: dict[str, Any] = {"padding": tuple(padding)}
    if "base_dilation" in eqn.params:
        base = list(eqn.params["base_dilation"])
        base[axis] = 1
        params["base_dilation"] = tuple(base)
    return params


def _rebind_reduce_window(eqn: JaxprEqn, invals: list, m: Mapping, start: Any, n: int) -> list:
    """A chunk of a pooled axis: the reduction of the chunk's windows, read from the whole
    operands with the reduction's own padding values."""
    axis, k = m.outs[0], operands(eqn)
    if axis is None or any(a is not None for a in m.ins):
        return bind_eqn(eqn, invals)
    win = window(eqn, axis)
    read = [win.read(x, axis, start, n, f) for x, f in zip(invals[:k], fills(eqn, invals))]
    return bind_eqn_with(eqn, read + invals[k:], **unpadded(eqn, axis))


def _passes(eqn: JaxprEqn, m: Mapping) -> bool:
    """Whether the axis passes through a one-wide window (the equation bound unchanged)."""
    return any(a is not None for a in m.ins)


#: The pooling reductions, one rule.
REDUCE_WINDOWS = ("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")
split_rule(*REDUCE_WINDOWS, rebind=_rebind_reduce_window, positional=_passes)(_reduce_window_map)


# -- window selections: select_and_scatter_add, select_and_gather_add ---------------------------


#: What each window selection does with the windows that overlap along a pooled axis.
_OVERLAPPING = {
    "select_and_scatter_add": "scatters overlapping windows along the split axis",
    "select_and_gather_add": "reads overlapping windows of the split axis",
}


def _window_selection_map(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """``select_and_scatter_add`` and ``select_and_gather_add``: a one-wide window passes the
    axis; along a pooled axis a chunk of the result reads the windows that overlap it, of both
    whole operands. Refused along a padded or base-dilated axis: which filled position a
    backend's selection picks differs (the CPU compares padding as a value)."""
    name = eqn.primitive.name
    win = window(eqn, axis)
    if win.trivial:
        return Mapping(ins=(axis, axis), outs=(axis,))
    if side[0] != "out":
        raise NoRule(f"{name} {_OVERLAPPING[name]}")
    if (win.pad_lo, win.pad_hi) != (0, 0):
        raise NoRule(f"{name} along a padded axis (backends select padding apart)")
    if win.base_dilation != 1:
        raise NoRule(f"{name} along a dilated axis (backends select filled positions apart)")
    return Mapping(ins=(None, None), outs=(axis,))


def _rebind_select_and_scatter_add(
    eqn: JaxprEqn, invals: list, m: Mapping, start: Any, n: int
) -> list:
    """Result positions ``[start, start + n)``: the windows that overlap them (the cotangent
    outside the source is 0, adding nothing), scattered into their span, then the chunk's part."""
    axis = m.outs[0]
    if axis is None or m.ins != (None, None):  # passing
        return bind_eqn(eqn, invals)
    source, operand = invals
    win = window(eqn, axis)
    size, stride = win.size, win.stride
    a = lax.convert_element_type(start, jnp.int32)
    first = (a - size + 1) // stride  # the first window that can reach position ``start``
    count = -(-(n + size + stride) // stride) + 1
    o = first + jnp.arange(count, dtype=jnp.int32)
    src = take(source, axis, o, (o >= 0) & (o < source.shape[axis]), 0)
    span = (count - 1) * stride + size
    q = first * stride + jnp.arange(span, dtype=jnp.int32)
    ops = take(operand, axis, q, (q >= 0) & (q < operand.shape[axis]), 0)
    (scattered,) = bind_eqn(eqn, [src, ops])
    return [lax.dynamic_slice_in_dim(scattered, a - first * stride, n, axis)]


split_rule(
    "select_and_scatter_add",
    rebind=_rebind_select_and_scatter_add,
    positional=lambda eqn, m: m.ins != (None, None),
)(_window_selection_map)


# -- select_and_gather_add -----------------------------------------------------------------------


def _rebind_select_and_gather_add(
    eqn: JaxprEqn, invals: list, m: Mapping, start: Any, n: int
) -> list:
    """Result positions ``[start, start + n)``: the selection over the chunk's windows, read
    from both whole operands."""
    axis = m.outs[0]
    if axis is None or m.ins != (None, None):  # passing
        return bind_eqn(eqn, invals)
    win = window(eqn, axis)
    read = [win.read(x, axis, start, n, jnp.zeros((), x.dtype)) for x in invals]
    return bind_eqn_with(eqn, read, **unpadded(eqn, axis))


split_rule(
    "select_and_gather_add",
    rebind=_rebind_select_and_gather_add,
    positional=lambda eqn, m: m.ins != (None, None),
)(_window_selection_map)
