"""One program of a fused kernel: a region's equations evaluated tile by tile along the split
axis, each tile's sink partials folded into the running ones by the sinks' reducers.

:class:`StagedBody` runs a region of one stage (every sink folded alone); :class:`OnlineBody` a
region that :mod:`memsafe.split.strategies.online` merged into one loop (the running maxima fold
first, the shifts are recomputed from them on the program's rows, and the other accumulators are
rescaled by its :class:`memsafe.split.strategies.online.Rescale` carry), as attention and
log-sum-exp rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from memsafe._jax import JaxprEqn, Literal, Var
from memsafe.fused import reduce
from memsafe.fused.kernel import Layout, stream
from memsafe.fused.tile import bind_tile
from memsafe.graph import Graph, evaluate_eqns
from memsafe.split.region import Region
from memsafe.split.registry import Mapping
from memsafe.split.sinks import Sink, finished
from memsafe.split.strategies.online import OnlinePlan, Rescale


def _read(env: dict[Var, Any], atom: Any) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


@dataclass(frozen=True)
class _TileValues:
    """A tile's values by variable (:class:`memsafe.graph.interpret.Values`); of an equation in
    ``kept`` (an online plan's pass-through products), only the operand it keeps is read (the
    other, a late factor, is applied after the kernel and is not one of its inputs)."""

    env: dict[Var, Any]
    kept: dict[int, int]

    def operands(self, i: int, eqn: JaxprEqn) -> list[Any]:
        k = self.kept.get(i)
        return [
            _read(self.env, a) if k is None or j == k else None for j, a in enumerate(eqn.invars)
        ]

    def define(self, i: int, eqn: JaxprEqn, outs: Sequence[Any]) -> None:
        self.env.update(zip(eqn.outvars, outs))


@dataclass(frozen=True)
class _Tiles:
    """What both bodies share: the program, its region and the tiles."""

    graph: Graph
    region: Region
    layout: Layout

    def env(self, fixed: dict[Var, Any], load: Callable[[Any], dict[Var, Any]], start: Any):
        env = dict(fixed)
        env.update(load(start))
        return env

    def tile(self, i: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any]:
        """Equation ``i`` on the tile, from its operands ``invals``."""
        return bind_tile(eqn, invals, [self.layout.shape(o) for o in eqn.outvars])

    def partial(self, i: int, invals: list[Any], start: Any, fresh: Any) -> Any:
        """Sink ``i``'s partial on the tile, from its operands ``invals`` (shared positions left
        out, :mod:`.reduce`)."""
        eqn, sink = self.graph.eqns[i], self.region.maps[i]
        assert isinstance(sink, Sink)
        return reduce.partial(eqn, sink, invals, start, self.layout.cols, fresh)


@dataclass(frozen=True)
class StagedBody(_Tiles):
    """One stage's loop of a staged region: ``order`` (its equations, program order) on each
    tile, the partials of ``sinks`` (the stage's own) folded; the results are the sinks'
    finished results. Sinks of earlier stages among ``order`` are not evaluated (their
    results are read from outside)."""

    order: tuple[int, ...]
    sinks: tuple[int, ...]

    def __call__(self, fixed: dict[Var, Any], load: Callable[[Any], dict[Var, Any]]) -> list:
        eqns, maps = self.graph.eqns, self.region.maps

        def step(state: list | None, j: Any) -> list:
            start, fresh = self.layout.tile_at(j)
            env = self.env(fixed, load, start)
            parts = []

            def bind(i: int, eqn: JaxprEqn, invals: list[Any]) -> Sequence[Any]:
                if isinstance(maps[i], Mapping):
                    return self.tile(i, eqn, invals)
                parts.append(self.partial(i, invals, start, fresh))
                return ()  # the partial is the kernel's, not a value of the tile

            order = [i for i in self.order if isinstance(maps[i], Mapping) or i in self.sinks]
            evaluate_eqns(eqns, order, env, bind)
            if state is None:
                return parts
            return [
                maps[i].reducer.fold(eqns[i], acc, new)
                for i, acc, new in zip(self.sinks, state, parts)
            ]

        state = stream(self.layout, step)
        return [
            r for i, acc in zip(self.sinks, state) for r in finished(maps[i].reducer, eqns[i], acc)
        ]


@dataclass(frozen=True)
class OnlineBody(_Tiles):
    """A region merged into one online loop (``plan``): each tile folds the running maxima,
    recomputes the shifts from them (the plan's chain, on the program's rows) and rescales the
    other accumulators. The results are those of :class:`Rescale` (a deferred sink's unfinished
    accumulator, the finished results of the others), sinks in program order."""

    plan: OnlinePlan
    order: tuple[int, ...]  # region and chain equations, program order
    others: tuple[int, ...]  # sinks that are not running maxima

    def __call__(self, fixed: dict[Var, Any], load: Callable[[Any], dict[Var, Any]]) -> list:
        eqns, maps, plan = self.graph.eqns, self.region.maps, self.plan
        carry = Rescale(self.graph, self.region, plan, self.others)

        def step(state: tuple | None, j: Any) -> tuple:
            start, fresh = self.layout.tile_at(j)
            env = self.env(fixed, load, start)
            running: dict[int, Any] = {}
            partials: dict[int, Any] = {}

            def bind(i: int, eqn: JaxprEqn, invals: list[Any]) -> Sequence[Any]:
                m = maps.get(i)
                if i in plan.passthrough:
                    return [self._pass_through(invals, i)]
                if m is None or isinstance(m, Mapping):
                    return self.tile(i, eqn, invals)  # a chain equation or a mapped one
                part = self.partial(i, invals, start, fresh)
                if i not in plan.sources:
                    partials[i] = part
                    return ()
                if state is not None:
                    part = m.reducer.fold(eqn, state[0][plan.sources.index(i)], part)
                running[i] = part
                return finished(m.reducer, eqn, part)  # the running maximum, read by the chain

            evaluate_eqns(eqns, self.order, _TileValues(env, plan.passthrough), bind)
            parts = (
                [running[i] for i in plan.sources],
                [env[u] for u in plan.shifts],
                [partials[i] for i in self.others],
            )
            return parts if state is None else carry.fold(state, parts)

        return carry.results(stream(self.layout, step))

    def _pass_through(self, invals: list[Any], i: int) -> Any:
        """A product with (or division by) a late factor: its kept operand, broadcast to the
        result's tile (the factor is applied after the kernel)."""
        out = self.graph.eqns[i].outvars[0]
        kept = invals[self.plan.passthrough[i]]
        return jnp.broadcast_to(kept, self.layout.shape(out)).astype(out.aval.dtype)
