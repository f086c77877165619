"""One program of a fused kernel: a region's equations evaluated tile by tile along the split
axis, each tile's sink partials folded into the running ones by the sinks' reducers.

:class:`StagedBody` runs a region of one stage (every sink folded alone); :class:`OnlineBody` a
region that :mod:`memsafe.split.strategies.online` merged into one loop (the running maxima fold
first, the shifts are recomputed from them on the program's rows, and the other accumulators are
rescaled by its :class:`memsafe.split.strategies.online.Rescale` carry), as attention and
log-sum-exp rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from memsafe._jax import Literal, Var
from memsafe.fused import reduce
from memsafe.fused.kernel import Layout, stream
from memsafe.fused.tile import bind_tile
from memsafe.graph import Graph
from memsafe.split.region import Region
from memsafe.split.registry import Mapping
from memsafe.split.sinks import Sink
from memsafe.split.strategies.online import OnlinePlan, Rescale


def _read(env: dict[Var, Any], atom: Any) -> Any:
    return atom.val if isinstance(atom, Literal) else env[atom]


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

    def bind(self, env: dict[Var, Any], i: int) -> None:
        """Equation ``i`` on the tile, its results into ``env``."""
        eqn = self.graph.eqns[i]
        shapes = [self.layout.shape(o) for o in eqn.outvars]
        env.update(zip(eqn.outvars, bind_tile(eqn, [_read(env, a) for a in eqn.invars], shapes)))

    def partial(self, env: dict[Var, Any], i: int, start: Any, fresh: Any) -> Any:
        """Sink ``i``'s partial on the tile (shared positions left out, :mod:`.reduce`)."""
        eqn, sink = self.graph.eqns[i], self.region.maps[i]
        assert isinstance(sink, Sink)
        invals = [_read(env, a) for a in eqn.invars]
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
            for i in self.order:
                if isinstance(maps[i], Mapping):
                    self.bind(env, i)
                elif i in self.sinks:
                    parts.append(self.partial(env, i, start, fresh))
            if state is None:
                return parts
            return [
                maps[i].reducer.fold(eqns[i], acc, new)
                for i, acc, new in zip(self.sinks, state, parts)
            ]

        state = stream(self.layout, step)
        return [r for i, acc in zip(self.sinks, state) for r in maps[i].reducer.finish(acc)]


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
            for i in self.order:
                m = maps.get(i)
                if m is None or (isinstance(m, Mapping) and i not in plan.passthrough):
                    self.bind(env, i)  # a chain equation (outside the region) or a mapped one
                elif i in plan.passthrough:
                    self._pass_through(env, i)
                elif i in plan.sources:
                    part = self.partial(env, i, start, fresh)
                    if state is not None:
                        old = state[0][plan.sources.index(i)]
                        part = m.reducer.fold(eqns[i], old, part)
                    running[i] = part
                    env.update(zip(eqns[i].outvars, m.reducer.finish(part)))
                else:
                    partials[i] = self.partial(env, i, start, fresh)
            parts = (
                [running[i] for i in plan.sources],
                [env[u] for u in plan.shifts],
                [partials[i] for i in self.others],
            )
            return parts if state is None else carry.fold(state, parts)

        return carry.results(stream(self.layout, step))

    def _pass_through(self, env: dict[Var, Any], i: int) -> None:
        """A product with (or division by) a late factor: its kept operand, broadcast to the
        result's tile (the factor is applied after the kernel)."""
        eqn = self.graph.eqns[i]
        kept = _read(env, eqn.invars[self.plan.passthrough[i]])
        out = eqn.outvars[0]
        env[out] = jnp.broadcast_to(kept, self.layout.shape(out)).astype(out.aval.dtype)
