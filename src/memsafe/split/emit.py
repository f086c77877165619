"""Emitting a split region as sequential loops, and re-tracing the program around them.

Each stage of a region becomes: the first chunk evaluated on its own (its partials start the
running results, so no identity elements are needed), a ``lax.scan`` over the remaining full
chunks, and one evaluation at the remainder's own static shape (no padding, so nothing foreign
reaches a max or a top_k). Chunk bodies are wrapped in ``jax.checkpoint`` so that differentiating
the emitted program does not store every chunk's intermediates. Surviving values are written into
full buffers with ``dynamic_update_slice``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from memsafe._jax import ClosedJaxpr, Literal, Var, bind_eqn, make_closed_jaxpr
from memsafe.graph import Graph
from memsafe.split import online, peephole
from memsafe.split.region import Region
from memsafe.split.registry import Mapping
from memsafe.split.sinks import Sink


@dataclass(frozen=True)
class Loop:
    """One stage of a region: the equations it evaluates per chunk, what it reads and returns."""

    stage: int
    eqns: tuple[int, ...]
    sliced: tuple[Var, ...]
    whole: tuple[Var, ...]
    sinks: tuple[int, ...]
    surviving: tuple[Var, ...]
    outputs: tuple[Var, ...]  # sink results then surviving values, in that order


def plan_loops(graph: Graph, region: Region) -> list[Loop]:
    eqns = graph.eqns
    loops = []
    for k in range(region.n_stages):
        idx = region.stage_eqns(graph, k)
        if not idx:
            continue
        sliced: dict[Var, None] = {}
        whole: dict[Var, None] = {}
        for i in idx:
            m = region.maps[i]
            for atom, ax in zip(eqns[i].invars, m.ins):
                if not isinstance(atom, Var) or isinstance(atom, Literal):
                    continue
                if atom in region.produced:
                    continue
                (sliced if ax is not None else whole)[atom] = None
        sinks = tuple(i for i in idx if isinstance(region.maps[i], Sink) and region.stage[i] == k)
        surv = set(region.surviving)
        surviving = tuple(
            o
            for i in idx
            if region.stage[i] == k and isinstance(region.maps[i], Mapping)
            for o in eqns[i].outvars
            if o in surv
        )
        outputs = tuple(o for i in sinks for o in eqns[i].outvars) + surviving
        loops.append(Loop(k, tuple(idx), tuple(sliced), tuple(whole), sinks, surviving, outputs))
    return loops


def _run_loop(
    graph: Graph, region: Region, loop: Loop, chunk: int, env: dict[Any, Any]
) -> list[Any]:
    """Evaluate one stage over all chunks; returns the values of ``loop.outputs``."""
    eqns = graph.eqns
    size = region.size
    axis_of = region.axis_of
    sliced_vals = [env[v] for v in loop.sliced]
    whole_vals = [env[v] for v in loop.whole]

    peep = peephole.plan(graph, region, loop.eqns, chunk)

    def body(start: Any, n: int, sliced: list[Any], whole: list[Any]) -> tuple[list, list]:
        local: dict[Any, Any] = {}
        outer = dict(zip(loop.whole, whole))
        for v, val in zip(loop.sliced, sliced):
            local[v] = lax.dynamic_slice_in_dim(val, start, n, axis_of[v])

        def read(atom: Any, ax: Any) -> Any:
            if isinstance(atom, Literal):
                return atom.val
            return outer[atom] if ax is None else local[atom]

        partials: list[Any] = []
        for i in loop.eqns:
            if i in peep.skip:
                continue
            eqn = eqns[i]
            m = region.maps[i]
            moved = peep.norm.get(i, {})
            invals = [
                None if k in moved else read(atom, ax)
                for k, (atom, ax) in enumerate(zip(eqn.invars, m.ins))
            ]
            if isinstance(m, Sink):
                if i in loop.sinks:
                    partials.append(m.reducer.partial(eqn, invals, m.axis, start, n))
                continue
            outs = peephole.bind_mapped(peep, i, eqn, invals, m, read, local, eqns, start, n)
            for var, val in zip(eqn.outvars, outs):
                local[var] = val
        return partials, [local[v] for v in loop.surviving]

    def chunk_fn(n: int) -> Callable[..., tuple[list, list]]:
        return jax.checkpoint(lambda start, sl, wh: body(start, n, sl, wh))

    sinks = [(eqns[i], region.maps[i]) for i in loop.sinks]

    def fold(acc: list, new: list) -> list:
        return [s.reducer.fold(e, a, b) for (e, s), a, b in zip(sinks, acc, new)]

    def write(bufs: list, vals: list, start: Any) -> list:
        return [
            lax.dynamic_update_slice_in_dim(b, v, start, axis_of[var])
            for b, v, var in zip(bufs, vals, loop.surviving)
        ]

    n_full, rem = divmod(size, chunk)
    full_fn = chunk_fn(chunk)
    acc, first = full_fn(jnp.int32(0), sliced_vals, whole_vals)
    bufs = [
        jnp.zeros(v.aval.shape, v.aval.dtype) for v in loop.surviving
    ]  # written in place chunk by chunk
    bufs = write(bufs, first, jnp.int32(0))
    if n_full > 1:

        def step(carry: tuple, i: Any) -> tuple[tuple, None]:
            acc, bufs = carry
            start = i * chunk
            new, vals = full_fn(start, sliced_vals, whole_vals)
            return (fold(acc, new), write(bufs, vals, start)), None

        (acc, bufs), _ = lax.scan(step, (acc, bufs), jnp.arange(1, n_full, dtype=jnp.int32))
    if rem:
        start = jnp.int32(n_full * chunk)
        new, vals = chunk_fn(rem)(start, sliced_vals, whole_vals)
        acc, bufs = fold(acc, new), write(bufs, vals, start)
    results: list[Any] = []
    for (_, s), a in zip(sinks, acc):
        results.extend(s.reducer.finish(a))
    return results + list(bufs)


def emit(closed: ClosedJaxpr, region: Region, chunk: int) -> ClosedJaxpr:
    """``closed`` with ``region`` computed in chunks of ``chunk`` along its axis."""
    graph = Graph(closed)
    eqns = graph.eqns
    loops = [] if region.online is not None else plan_loops(graph, region)
    # Nodes: outside equations and one node per loop, run in a topological order that keeps the
    # original program order wherever dependencies allow. An online region is one loop and a
    # "fin" node applying factors computed after the loop to its accumulators.
    nodes: list[tuple[str, int]] = [("eqn", i) for i in range(len(eqns)) if i not in region.maps]
    nodes += [("loop", k) for k in range(len(loops))]
    if region.online is not None:
        o_in, o_out, f_in, f_out = online.loop_io(graph, region)
        nodes += [("online", 0), ("fin", 0)]

    def needs(node: tuple[str, int]) -> list[Any]:
        if node[0] == "eqn":
            return [a for a in eqns[node[1]].invars if isinstance(a, Var)]
        if node[0] == "online":
            return o_in
        if node[0] == "fin":
            return f_in
        loop = loops[node[1]]
        return [*loop.sliced, *loop.whole]

    def gives(node: tuple[str, int]) -> list[Any]:
        if node[0] == "online":
            return o_out
        if node[0] == "fin":
            return f_out
        return list(eqns[node[1]].outvars) if node[0] == "eqn" else list(loops[node[1]].outputs)

    def key(node: tuple[str, int]) -> int:
        if node[0] == "online":
            return min(region.maps)
        if node[0] == "fin":
            return max(region.maps)
        return node[1] if node[0] == "eqn" else min(loops[node[1]].eqns)

    producer = {v: n for n in nodes for v in gives(n)}
    deps: dict[tuple[str, int], set] = {}
    users: dict[tuple[str, int], list] = {n: [] for n in nodes}
    for n in nodes:
        deps[n] = {producer[v] for v in needs(n) if v in producer}
        for d in deps[n]:
            users[d].append(n)
    ready = [(key(n), n) for n in nodes if not deps[n]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for u in users[n]:
            deps[u].discard(n)
            if not deps[u]:
                heapq.heappush(ready, (key(u), u))
    if len(order) != len(nodes):
        raise RuntimeError("memsafe split: the region's loops form a dependency cycle")

    jaxpr = closed.jaxpr

    def run(*args: Any) -> list[Any]:
        env: dict[Any, Any] = {}
        for var, val in zip(jaxpr.constvars, closed.consts):
            env[var] = val
        for var, val in zip(jaxpr.invars, args):
            env[var] = val

        def read(atom: Any) -> Any:
            return atom.val if isinstance(atom, Literal) else env[atom]

        for kind, i in order:
            if kind == "eqn":
                outs = bind_eqn(eqns[i], [read(a) for a in eqns[i].invars])
                env.update(zip(eqns[i].outvars, outs))
            elif kind == "online":
                env.update(zip(o_out, online.run_loop(graph, region, chunk, env)))
            elif kind == "fin":
                env.update(zip(f_out, online.finish(graph, region, env)))
            else:
                env.update(zip(loops[i].outputs, _run_loop(graph, region, loops[i], chunk, env)))
        return [read(a) for a in jaxpr.outvars]

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
    new, _ = make_closed_jaxpr(run, avals)
    return new
