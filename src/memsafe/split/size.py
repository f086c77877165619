"""Choosing the chunk size of a region from the memory budget.

The model is deliberately conservative, from what XLA's CPU backend was measured to do: a value is
stored per chunk when a non-elementwise operation (dot, reduction, top_k, sort, ...) produces or
reads it (XLA splits reductions into a reduce-window and a reduce and materializes their
elementwise input), or when it is written out. Values that only feed elementwise ops fuse away.
The driver verifies the result against XLA's buffer assignment and shrinks ``chunk_scale`` if the
model was optimistic.
"""

from __future__ import annotations

from dataclasses import dataclass

from memsafe._jax import Var
from memsafe.graph import Graph
from memsafe.graph.estimate import FUSIBLE
from memsafe.split.axis_rules import ELEMENTWISE, Sink
from memsafe.split.region import Region
from memsafe.split.sinks import min_chunk

#: Operations that read their operands without storing them (elementwise, layout, generators).
_STREAMING = frozenset(ELEMENTWISE) | {
    "broadcast_in_dim",
    "reshape",
    "squeeze",
    "expand_dims",
    "iota",
    "slice",
    "pad",
    "concatenate",
    "rev",
    "dynamic_slice",
}


@dataclass(frozen=True)
class ChunkPlan:
    """The chosen chunk of a region and the model's numbers behind it."""

    chunk: int
    loops: int  # chunks per stage (remainder included)
    stages: int
    per_unit: int  # bytes stored per unit of the split axis, in the largest stage
    fixed: int  # bytes the loops hold regardless of the chunk (accumulators, buffers, leaves)

    @property
    def iterations(self) -> int:
        return self.loops * self.stages


def _stored(graph: Graph, region: Region, var: Var, in_stage: set[int]) -> bool:
    info = graph.info(var)
    p = info.producer
    if p is not None and p in region.maps and graph.eqns[p].primitive.name not in FUSIBLE:
        return True
    if var in region.surviving:
        return True
    for c in info.consumers:
        if c in in_stage and graph.eqns[c].primitive.name not in _STREAMING:
            return True
    return False


def bytes_model(graph: Graph, region: Region) -> tuple[int, int]:
    """(bytes per unit of the axis stored in the worst stage, fixed bytes of the loops)."""
    eqns = graph.eqns
    per_unit = 0
    for k in range(region.n_stages):
        idx = set(region.stage_eqns(graph, k))
        values: set[Var] = set()
        for i in idx:
            for a in eqns[i].invars:
                if isinstance(a, Var) and a in region.axis_of:
                    values.add(a)
            if not isinstance(region.maps[i], Sink):
                values.update(o for o in eqns[i].outvars if o in region.axis_of)
        stage_bytes = sum(graph.info(v).bytes for v in values if _stored(graph, region, v, idx))
        per_unit = max(per_unit, -(-stage_bytes // region.size))
    fixed = 0
    for i in region.sinks:
        fixed += 3 * sum(graph.info(o).bytes for o in eqns[i].outvars)  # acc, partial, result
    for v in region.surviving:
        if not graph.info(v).is_output:
            fixed += graph.info(v).bytes
    for v in region.sliced | region.whole:
        info = graph.info(v)
        if info.producer is not None and not info.is_output:
            fixed += info.bytes
    return per_unit, fixed


def choose_chunk(graph: Graph, region: Region, budget: int) -> ChunkPlan | None:
    """The largest chunk whose modelled bytes fit ``budget``, evened out over the loop count;
    None if even the smallest chunk does not fit."""
    per_unit, fixed = bytes_model(graph, region)
    eqns = graph.eqns
    lowest = max([1, *(min_chunk(eqns[i], s) for i, s in region.sinks.items())])
    room = budget - fixed
    if room < per_unit * lowest:
        return None
    chunk = min(region.size, room // max(per_unit, 1))
    loops = -(-region.size // chunk)
    chunk = max(lowest, -(-region.size // loops))  # same loop count, smaller remainder waste
    loops = -(-region.size // chunk)
    return ChunkPlan(chunk, loops, region.n_stages, per_unit, fixed)
