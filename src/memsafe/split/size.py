"""Choosing the chunk size of a region from the memory budget.

The model is deliberately conservative, from what XLA's CPU backend was measured to do: a value is
stored per chunk when a non-elementwise operation (dot, reduction, top_k, sort, ...) produces or
reads it (XLA splits reductions into a reduce-window and a reduce and materializes their
elementwise input), or when it is written out. Values that only feed elementwise ops fuse away.
The driver verifies the result against XLA's buffer assignment and shrinks ``chunk_scale`` if the
model was optimistic.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from memsafe import policy
from memsafe._jax import Var
from memsafe.graph import Graph
from memsafe.primitives import FUSIBLE
from memsafe.split import speed
from memsafe.split.emit import Split
from memsafe.split.region import Region, SplitFailure
from memsafe.split.sinks import TOP_K, Sink

#: Operations that read their operands without storing them (elementwise, layout, generators).
_STREAMING = FUSIBLE


@dataclass(frozen=True)
class ChunkPlan:
    """The chosen chunk of a region and the model's numbers behind it."""

    chunk: int
    loops: int  # chunks per stage (remainder included)
    stages: int
    per_unit: int  # bytes stored per unit of the split axis, in the largest stage
    fixed: int  # bytes the loops hold regardless of the chunk (accumulators, buffers, leaves)
    share: int  # length of the axis one device loops over (the whole axis on one device)
    devices: int = 1  # devices sharing the axis, each looping over its share (strategies.sharded)
    floored: bool = False  # the model expects even this smallest chunk over the budget
    halved: bool = False  # the model expects the whole axis to fit: two chunks, to be verified
    held: bool = False  # values held whole measured against the room (planner.best_split)

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


def _stage_peak(graph: Graph, region: Region, idx: list[int]) -> int:
    """Peak bytes of stored chunk values over one stage's body, in program order."""
    eqns = graph.eqns
    members = set(idx)
    stored: dict[Var, int] = {}  # value -> last position (in idx) that reads it
    for pos, i in enumerate(idx):
        values = [a for a in eqns[i].invars if isinstance(a, Var) and a in region.axis_of]
        if not isinstance(region.maps[i], Sink):
            values += [o for o in eqns[i].outvars if o in region.axis_of]
        for v in values:
            if _stored(graph, region, v, members):
                stored[v] = pos
    born: dict[Var, int] = {}
    for v in stored:
        p = graph.info(v).producer
        born[v] = idx.index(p) if p in members else 0
        if v in region.surviving:
            stored[v] = len(idx)
    # XLA fuses a chain of streaming ops into the op that materializes its end: a stored value
    # read by such a chain stays live until the chain's end is born (a dot's output and the
    # elementwise result it feeds to top_k are held together).
    position = {i: pos for pos, i in enumerate(idx)}
    reach: dict[Var, int] = {}

    def chain_end(v: Var) -> int:
        if v in reach:
            return reach[v]
        reach[v] = end = -1
        for c in graph.info(v).consumers:
            if c not in members or eqns[c].primitive.name not in _STREAMING:
                continue
            for o in eqns[c].outvars:
                if o not in region.axis_of:
                    continue
                end = max(end, position[c], born[o] if o in stored else chain_end(o))
        reach[v] = end
        return end

    for v in stored:
        stored[v] = max(stored[v], chain_end(v))
    peak = 0
    for pos in range(len(idx) + 1):
        live = sum(graph.info(v).bytes for v in stored if born[v] <= pos <= stored[v])
        peak = max(peak, live)
    return peak


def bytes_model(graph: Graph, region: Region) -> tuple[int, int]:
    """(bytes per unit of the axis stored at the worst point of any stage, fixed bytes)."""
    eqns = graph.eqns
    per_unit = 0
    read: set[Var] = set()  # outside values the loops read
    for k in range(region.n_stages):
        idx = region.stage_eqns(graph, k)
        peak = _stage_peak(graph, region, idx)
        per_unit = max(per_unit, -(-peak // region.size))
        read.update(a for i in idx for a in eqns[i].invars if isinstance(a, Var))
    fixed = 0
    for i, sink in region.sinks.items():
        for o in eqns[i].outvars:  # the running result and a chunk's partial, the result
            fixed += 2 * sink.reducer.running_bytes(o.aval) + graph.info(o).bytes
        operand = graph.info(eqns[i].invars[0]).bytes
        per_unit += sink.reducer.extra_bytes_per_unit(operand, region.size)
    for i in region.maps:  # a scan's carry threaded from chunk to chunk: in, out, result
        fixed += 3 * sum(graph.info(o).bytes for o in region.after_loop(graph, i))
    for v in region.surviving:
        if not graph.info(v).is_output:
            fixed += graph.info(v).bytes
    # only what the loops read is held for them: the growth gives an axis to values no loop
    # reads (a checkpointed block's backward: 1.6 GiB of the 1.8 GiB it counted)
    for v in {*region.sliced, *region.whole} & read:
        info = graph.info(v)
        if info.producer is not None and not info.is_output:
            fixed += info.bytes
    return per_unit, fixed


def _chunk_bytes(graph: Graph, region: Region, chunk: int) -> int:
    """Bytes the region's sinks allocate per chunk beyond what scales with it (top_k's
    candidates)."""
    sinks = region.sinks.items()
    return sum(s.reducer.chunk_bytes(graph.eqns[i], s.axis, chunk) for i, s in sinks)


def _lowest(graph: Graph, region: Region) -> int:
    """The smallest chunk every sink of the region can work with."""
    return max([1, *(s.reducer.min_chunk(graph.eqns[i]) for i, s in region.sinks.items())])


def _evened(size: int, chunk: int, lowest: int) -> tuple[int, int]:
    """(chunk, loops): the same loop count as ``chunk`` gives, with the smallest remainder."""
    loops = -(-size // max(chunk, lowest))
    chunk = max(lowest, -(-size // loops))
    return chunk, -(-size // chunk)


def choose_chunk(graph: Graph, split: Split, budget: int) -> ChunkPlan | None:
    """The largest chunk whose modelled bytes fit ``budget``, evened out over the loop count
    over one device's share of the axis; None if even the smallest chunk does not fit."""
    region, share = split.region, split.share
    per_unit, fixed = bytes_model(graph, region)
    fixed += split.fixed_bytes(graph)
    lowest = _lowest(graph, region)
    room = budget - fixed - 2 * region.span.extend * per_unit  # 2E more positions a chunk
    if room < per_unit * lowest or share < lowest:
        return None
    chunk = min(share, room // max(per_unit, 1))
    for _ in range(3):  # the candidates shrink with the chunk: settle the two
        fits = (room - _chunk_bytes(graph, region, chunk)) // max(per_unit, 1)
        if fits >= chunk:
            break
        chunk = max(fits, lowest)
    chunk, loops = _evened(share, chunk, lowest)
    return ChunkPlan(chunk, loops, region.n_stages, per_unit, fixed, share, split.devices)


def smallest_chunk(graph: Graph, split: Split, floor_budget: int = 0) -> ChunkPlan:
    """The chunk for when the model expects every chunk over the budget: the model is
    conservative (it counts every stored value at its worst point, and values held beside the
    loop anyway), so the compile, not the model, decides whether this fits. The chunk's own
    modelled bytes take at most ``floor_budget // policy.SPLIT.floor_part``, and never less than
    the smallest chunk the region's sinks allow (``floor_budget`` 0: that smallest chunk).
    Chunks of one row made a transformer block's backward at L=4096 run 3 x 4,096 iterations of
    under 1 MiB where its temporaries fit 100 MiB."""
    region = split.region
    per_unit, fixed = bytes_model(graph, region)
    share, lowest = split.share, _lowest(graph, region)
    if share < lowest:
        raise SplitFailure(f"a share of {share} is shorter than the smallest chunk ({lowest})")
    wide = floor_budget // policy.SPLIT.floor_part // max(per_unit, 1)
    chunk, loops = _evened(share, min(share, max(lowest, wide)), lowest)
    fixed += split.fixed_bytes(graph)
    return ChunkPlan(
        chunk, loops, region.n_stages, per_unit, fixed, share, split.devices, floored=True
    )


def two_chunks(graph: Graph, split: Split, plan: ChunkPlan) -> ChunkPlan | None:
    """``plan`` in two chunks, for a value too large to keep whole whose region the model
    expects to fit the budget in one (the compile decides, and later attempts shrink further);
    None where the axis is too short for two chunks its sinks allow."""
    lowest = _lowest(graph, split.region)
    if plan.share < 2 * lowest:
        return None
    chunk, loops = _evened(plan.share, -(-plan.share // 2), lowest)
    return dataclasses.replace(plan, chunk=chunk, loops=loops, halved=True)


def _has_gemm(graph: Graph, region: Region) -> bool:
    """Whether the region runs a matrix-matrix product (compute-bound: long chunks pay)."""
    for i in region.maps:
        eqn = graph.eqns[i]
        if eqn.primitive.name == "triangular_solve":
            return True
        if eqn.primitive.name != "dot_general":
            continue
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        sides = [
            math.prod(d for k, d in enumerate(atom.aval.shape) if k not in (*con, *bat))
            for atom, con, bat in ((eqn.invars[0], lc, lb), (eqn.invars[1], rc, rb))
        ]
        if min(sides) >= policy.SPLIT.gemm_side:
            return True
    return False


def speed_cap(graph: Graph, region: Region, plan: ChunkPlan) -> ChunkPlan:
    """``plan`` with its chunk lowered to the backend's speed cap of modelled values
    (``chunk_bytes`` of :mod:`memsafe.split.speed`), where that helps: a memory-bound region's
    chunks run fastest near the caches (CPU) or in few long iterations (GPU). Regions with a
    matrix-matrix product are exempt (the SGPR gradient at N=200k ran 14.3 s capped, 12.1 s not,
    on a CPU), and so are chunks feeding a top_k sink, which pays a top_k call per row and
    chunk."""
    if any(s.reducer is TOP_K for s in region.sinks.values()) or _has_gemm(graph, region):
        return plan
    cap = max(speed.current().chunk_bytes // max(plan.per_unit, 1), 1)
    if plan.chunk <= cap:
        return plan
    chunk, loops = _evened(plan.share, cap, _lowest(graph, region))
    return dataclasses.replace(plan, chunk=chunk, loops=loops)
