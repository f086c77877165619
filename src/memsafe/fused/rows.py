"""The row axes of a fused region: axes other than the split axis that every value the kernel
writes carries, so that each program of the kernel's grid computes its own tile of them.

The split axis ``S`` of a region is the one its sinks consume; the kernel streams it. A row axis
``R`` is found the way a split region is grown (:mod:`memsafe.split.region`), with the same split
rules (:func:`memsafe.split.registry.axis_map`), but only through the equations the kernel
evaluates: every one must map ``R`` through (no equation may reduce over it), and every result
the kernel writes must carry it. Values that do not carry it (``|y|^2`` of a distance, computed
from the streamed side alone) are computed whole along it, the same in every program.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from memsafe._jax import Var, is_var
from memsafe.graph import Graph
from memsafe.split.registry import PLAIN, Mapping, NoRule, axis_map


@dataclass(frozen=True)
class RowAxis:
    """One row axis: its length and its position in every value that carries it."""

    size: int
    at: dict[Var, int]


class _Conflict(Exception):
    """The axis cannot be a row axis (it is reduced over, lost, or reached in two ways)."""


def propagate(graph: Graph, members: frozenset[int], seed: Var, axis: int) -> RowAxis | None:
    """Row axis ``axis`` of ``seed`` carried through the equations ``members`` (by index) and
    the values they read; None where some equation reduces over it, loses it or reaches it in
    two ways.

    Args:
        graph: the program.
        members: the equations the kernel evaluates.
        seed: a value they compute.
        axis: the axis of ``seed`` to carry.

    Returns:
        The axis, with its position in every value reached, or None.
    """
    size = graph.info(seed).shape[axis]
    at: dict[Var, int] = {seed: axis}
    maps: dict[int, Mapping] = {}
    queue: deque[Var] = deque([seed])

    def assign(atom: object, ax: int | None) -> None:
        if not is_var(atom):
            if ax is not None:
                raise _Conflict
            return
        if ax is None:
            return
        assert isinstance(atom, Var)
        if graph.info(atom).shape[ax] != size or at.get(atom, ax) != ax:
            raise _Conflict
        if atom not in at:
            at[atom] = ax
            queue.append(atom)

    def add(i: int, side: tuple[str, int], ax: int) -> None:
        eqn = graph.eqns[i]
        try:
            m = axis_map(eqn, side, ax, PLAIN)
        except NoRule as err:
            raise _Conflict from err
        if not isinstance(m, Mapping):
            raise _Conflict  # a sink of the row axis: it is reduced over
        if maps.setdefault(i, m) != m:
            raise _Conflict
        if any(ax is None for ax in m.outs):
            raise _Conflict  # a result without the row axis (a scan's final carry)
        for atom, a in zip(eqn.invars, m.ins):
            assign(atom, a)
        for atom, a in zip(eqn.outvars, m.outs):
            assign(atom, a)

    try:
        while queue:
            var = queue.popleft()
            info = graph.info(var)
            p = info.producer
            if p is not None and p in members and p not in maps:
                add(p, ("out", list(graph.eqns[p].outvars).index(var)), at[var])
            for c in info.consumers:
                if c in members and c not in maps:
                    k = next(k for k, a in enumerate(graph.eqns[c].invars) if a is var)
                    add(c, ("in", k), at[var])
    except _Conflict:
        return None
    return RowAxis(size, at)


def row_axes(
    graph: Graph, members: frozenset[int], seed: Var, split_axis: int, written: Iterable[Var]
) -> tuple[RowAxis, ...]:
    """The row axes of a kernel evaluating ``members``: each axis of ``seed`` but
    ``split_axis`` that carries through them and is carried by every value in ``written``, at
    distinct positions of every value."""
    written = tuple(written)
    found: list[RowAxis] = []
    for axis, n in enumerate(graph.info(seed).shape):
        if axis == split_axis or n < 2:
            continue
        row = propagate(graph, members, seed, axis)
        if row is None or any(v not in row.at for v in written):
            continue
        if any(row.at[v] == other.at.get(v) for other in found for v in row.at):
            continue
        found.append(row)
    return tuple(found)
