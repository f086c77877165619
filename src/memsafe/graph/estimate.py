"""Estimate which values XLA will materialize and the program's peak, without compiling.

XLA fuses elementwise chains into their consumer; large buffers appear at fusion boundaries
(../shared/DESIGN.md, measured facts). This estimate is only used to choose what to rewrite; the
driver always verifies against XLA's own buffer assignment.
"""

from __future__ import annotations

from dataclasses import dataclass

from memsafe._jax import Var
from memsafe.graph.graph import Graph
from memsafe.primitives import FUSIBLE, REDUCTIONS, STREAMED

__all__ = ["Estimate", "estimate", "materialized_values"]


def needs_operands_in_memory(primitive: str) -> bool:
    """Ops whose operands XLA materializes (library calls, layouts it cannot fuse through)."""
    return primitive not in STREAMED and primitive not in REDUCTIONS


@dataclass(frozen=True)
class Estimate:
    """Values estimated to be materialized, and the peak of their live bytes in program order."""

    materialized: frozenset[Var]
    peak_bytes: int


def materialized_values(graph: Graph) -> frozenset[Var]:
    """Values estimated to live in their own buffer (inputs, outputs, fusion boundaries)."""
    eqns = graph.eqns
    out: set[Var] = set()
    for vi in graph.values():
        if vi.is_input or vi.is_const or vi.is_output:
            out.add(vi.var)
            continue
        producer = eqns[vi.producer]
        name = producer.primitive.name
        if name not in FUSIBLE:
            out.add(vi.var)  # dots, reductions, sorts, loops, custom calls produce buffers
            continue
        if any(needs_operands_in_memory(eqns[c].primitive.name) for c in vi.consumers):
            out.add(vi.var)
    return frozenset(out)


def estimate(graph: Graph) -> Estimate:
    """Peak of live materialized bytes, scanning equations in program order."""
    mat = materialized_values(graph)
    live = sum(graph.info(v).bytes for v in mat if graph.info(v).producer is None)
    peak = live
    frees: dict[int, int] = {}
    for v in mat:
        vi = graph.info(v)
        if vi.producer is not None and not vi.is_output:
            frees[vi.last_use] = frees.get(vi.last_use, 0) + vi.bytes
    for i, eqn in enumerate(graph.eqns):
        live += sum(graph.info(o).bytes for o in eqn.outvars if o in mat)
        peak = max(peak, live)
        live -= frees.get(i, 0)
    return Estimate(materialized=mat, peak_bytes=peak)
