"""Hoist: windows of large computed values move above the operations that computed them.

``jnp.flip(x @ y.T, 0)``, ``(x @ y.T)[1:]`` and ``lax.dynamic_slice_in_dim(s, i, n, 1)`` select
positions along one axis of a value computed whole. A split region follows one axis from the chunk's
start, so it stopped at such a window of a computed value: the window's chunk reads the value's
chunk at other positions. Where each position of a value along the axis depends only on the same
position of its operands (elementwise operations, broadcasts, transposes, reductions and scans over
other axes, a matmul's free and batch axes: the equations whose split rule calls them positional,
``memsafe.split.registry.positional``), the window commutes with the operation, which then runs on
windowed operands. Applied up the chain, the window reaches program arguments or small values, which
the split rules read by index arithmetic. The same elements go through the same operations;
discarded positions are no longer computed.

The window moves above a cone of values larger than an eighth of the temporary budget (smaller ones
fit as they are, and take the window where the cone reads them), and only where nothing but the cone
reads those values (otherwise they would be computed twice) and the window would not stay on a large
one. Loop bodies and cond branches are rewritten the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax import lax

from memsafe import policy
from memsafe._jax import (
    LOOP_BODIES,
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    Var,
    dce,
    is_var,
    make_closed_jaxpr,
    nbytes_of_aval,
)
from memsafe.context import PassContext
from memsafe.graph.bodies import runs_any, with_bodies
from memsafe.graph.interpret import evaluate
from memsafe.plan import PassRecord
from memsafe.primitives import BROADCASTS
from memsafe.split import registry
from memsafe.split.registry import Mapping, NoRule


class Window:
    """Positions selected along one axis."""

    def apply(self, value: Any, axis: int) -> Any:
        """``value`` at the selected positions along ``axis``."""
        raise NotImplementedError

    def length(self, full: int) -> int:
        """How many positions are selected of an axis of length ``full``."""
        raise NotImplementedError


@dataclass(frozen=True)
class Strided(Window):
    """``start:limit:stride`` (a static slice)."""

    start: int
    limit: int
    stride: int

    def apply(self, value: Any, axis: int) -> Any:
        return lax.slice_in_dim(value, self.start, self.limit, self.stride, axis)

    def length(self, full: int) -> int:
        return len(range(self.start, self.limit, self.stride))


@dataclass(frozen=True)
class Reversed(Window):
    """Every position, last first (``rev``)."""

    def apply(self, value: Any, axis: int) -> Any:
        return lax.rev(value, (axis,))

    def length(self, full: int) -> int:
        return full


@dataclass(frozen=True)
class Dynamic(Window):
    """``size`` positions from a traced ``index``, clamped into the axis as XLA clamps it."""

    index: Any
    size: int

    def apply(self, value: Any, axis: int) -> Any:
        return lax.dynamic_slice_in_dim(value, self.index, self.size, axis)

    def length(self, full: int) -> int:
        return self.size


def _only(axes: list[int]) -> int | None:
    return axes[0] if len(axes) == 1 else None


def _slice(eqn: JaxprEqn, invals: list[Any]) -> tuple[int, Window] | None:
    p, full = eqn.params, eqn.invars[0].aval.shape
    strides = p["strides"] or (1,) * len(full)
    cut = zip(p["start_indices"], p["limit_indices"], strides)
    axis = _only([a for a, (s, e, k) in enumerate(cut) if (s, e, k) != (0, full[a], 1)])
    if axis is None:
        return None
    return axis, Strided(p["start_indices"][axis], p["limit_indices"][axis], strides[axis])


def _rev(eqn: JaxprEqn, invals: list[Any]) -> tuple[int, Window] | None:
    full = eqn.invars[0].aval.shape
    axis = _only([a for a in eqn.params["dimensions"] if full[a] > 1])
    return None if axis is None else (axis, Reversed())


def _dynamic_slice(eqn: JaxprEqn, invals: list[Any]) -> tuple[int, Window] | None:
    full = eqn.invars[0].aval.shape
    if len(invals) != 1 + len(full):
        return None
    axis = _only([a for a, n in enumerate(eqn.params["slice_sizes"]) if n != full[a]])
    return (
        None if axis is None else (axis, Dynamic(invals[1 + axis], eqn.params["slice_sizes"][axis]))
    )


#: The window each primitive selecting positions along an axis selects, by primitive (None:
#: not along exactly one axis).
WINDOWS: dict[str, Callable[[JaxprEqn, list[Any]], tuple[int, Window] | None]] = {
    "slice": _slice,
    "rev": _rev,
    "dynamic_slice": _dynamic_slice,
}


def window_of(eqn: JaxprEqn, invals: list[Any]) -> tuple[int, Window] | None:
    """(axis, window) when ``eqn`` selects positions along exactly one axis, else None."""
    found = WINDOWS.get(eqn.primitive.name)
    return None if found is None else found(eqn, invals)


class _Hoist:
    """The rewrite of one program: windows of large values move up their chains."""

    def __init__(self, closed: ClosedJaxpr, large: int, changes: list[str]) -> None:
        jaxpr = closed.jaxpr
        self.eqns = jaxpr.eqns
        self.large, self.changes = large, changes
        self.users: dict[Var, set[int]] = {}
        for i, e in enumerate(jaxpr.eqns):
            for a in e.invars:
                if is_var(a):
                    self.users.setdefault(a, set()).add(i)
        self.outputs = {a for a in jaxpr.outvars if is_var(a)}
        self.producer = {o: i for i, e in enumerate(jaxpr.eqns) for o in e.outvars}
        self.env: dict[Any, Any] = {}

    def __call__(self, index: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        if eqn.primitive.name in LOOP_BODIES:
            return with_bodies(eqn, invals, lambda b: hoist(b, self.large, self.changes))
        found = window_of(eqn, invals)
        root = eqn.invars[0] if eqn.invars else None
        if found is None or not self._large(root) or self._read_elsewhere(root, {index}):
            return None
        axis, window = found
        cone = self._cone(root, axis)
        if cone is None:
            return None
        out = self._build(root, axis, window, cone, {})
        moved = self.eqns[self.producer[root]].primitive.name
        self.changes.append(f"{eqn.primitive.name} along axis {axis} computed before {moved}")
        return [out]

    def _large(self, atom: Any) -> bool:
        """A value computed by the program, larger than what fits as it is."""
        return is_var(atom) and atom in self.producer and nbytes_of_aval(atom.aval) > self.large

    def _read_elsewhere(self, var: Var, inside: set[int]) -> bool:
        """Whether ``var`` is an output or read by an equation not in ``inside``."""
        return var in self.outputs or not self.users.get(var, set()) <= inside

    def _mapping(self, eqn: JaxprEqn, axis: int) -> Mapping | None:
        """How ``axis`` of the result of ``eqn`` maps onto its operands, where the window
        commutes with ``eqn`` (a pointwise mapping that some operand carries, or a broadcast)."""
        if len(eqn.outvars) != 1:
            return None
        try:
            m = registry.axis_map(eqn, ("out", 0), axis, registry.PLAIN)
        except NoRule:
            return None
        if not isinstance(m, Mapping) or not registry.positional(eqn, m):
            return None
        # an axis a broadcast creates holds the same values at every position: the window is
        # the broadcast at the window's length
        creates = eqn.primitive.name in BROADCASTS
        return m if creates or any(a is not None for a in m.ins) else None

    def _cone(self, root: Var, axis: int) -> dict[Var, tuple[int, Mapping]] | None:
        """The large computed values the window moves above, each with the axis it reads and how
        that axis maps through its producer, from
        ``root`` up to arguments and small values. None where the window would stay on a large
        value: one whose producer it does not commute with, one read along two axes, or one read
        by an operation outside the cone (it would be computed twice). A split stops at such a
        window as it did before, and the values around it would be computed in other fusions
        than jax.jit's: a max recomputed per stage next to a reversed operand rounded otherwise
        than its ties did (fuzz seed 258, a max's gradient: tie count 0, NaN everywhere)."""
        cone: dict[Var, tuple[int, Mapping]] = {}
        stack = [(root, axis)]
        while stack:
            var, ax = stack.pop()
            if var in cone:
                if cone[var][0] != ax:
                    return None
                continue
            eqn = self.eqns[self.producer[var]]
            m = self._mapping(eqn, ax)
            if m is None:
                return None
            cone[var] = ax, m
            stack.extend((a, a_ax) for a, a_ax in zip(eqn.invars, m.ins) if a_ax is not None
                         and self._large(a))  # fmt: skip
        inside = {self.producer[v] for v in cone}
        if any(self._read_elsewhere(v, inside) for v in cone if v is not root):
            return None
        return cone

    def _build(
        self, var: Any, axis: int | None, window: Window, cone: dict[Var, tuple[int, Mapping]],
        memo: dict,
    ) -> Any:  # fmt: skip
        """``var`` read through the window along ``axis`` (whole where None): computed from
        windowed operands where it is in ``cone``, else the window applied to it."""
        if isinstance(var, Literal):
            return var.val
        if axis is None:
            return self.env[var]
        if (var, axis) not in memo:
            if var in cone:  # the cone reads each of its values along one axis: this one
                eqn, m = self.eqns[self.producer[var]], cone[var][1]
                ops = [self._build(a, ax, window, cone, memo) for a, ax in zip(eqn.invars, m.ins)]
                size = window.length(var.aval.shape[axis])
                (memo[var, axis],) = registry.rebind(eqn, ops, m, 0, size)
            else:
                memo[var, axis] = window.apply(self.env[var], axis)
        return memo[var, axis]


def hoist(closed: ClosedJaxpr, large: int, changes: list[str]) -> ClosedJaxpr:
    """``closed`` with windows of values over ``large`` bytes moved up (itself if none moved);
    what changed is appended to ``changes``."""
    if not runs_any(closed, WINDOWS):
        return closed
    before = len(changes)
    rewrite = _Hoist(closed, large, changes)
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    # the evaluator keeps every value it computes in ``rewrite.env``, where the rewrite reads them
    new, _ = make_closed_jaxpr(lambda *xs: evaluate(closed, xs, rewrite, env=rewrite.env), avals)
    return closed if len(changes) == before else dce(new)


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Move slices and reversals of large computed values above the operations computing them."""
    changes: list[str] = []
    new = hoist(closed, int(ctx.temp_budget * policy.REWRITE.hoist_small), changes)
    for change in dict.fromkeys(changes):
        ctx.record(PassRecord("hoist", change))
    return new


__all__ = ["WINDOWS", "Window", "hoist", "run", "window_of"]
