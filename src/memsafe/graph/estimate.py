"""Estimate which values XLA will materialize and the program's peak, without compiling.

XLA fuses elementwise chains into their consumer; large buffers appear at fusion boundaries
(../shared/DESIGN.md, measured facts). This estimate is only used to choose what to rewrite; the
driver always verifies against XLA's own buffer assignment.
"""

from __future__ import annotations

from dataclasses import dataclass

from memsafe._jax import Var
from memsafe.graph.graph import Graph

#: Primitives XLA fuses into their consumers (elementwise, layout-free, generators).
FUSIBLE = frozenset(
    {
        "add",
        "sub",
        "mul",
        "div",
        "rem",
        "pow",
        "integer_pow",
        "max",
        "min",
        "neg",
        "sign",
        "floor",
        "ceil",
        "round",
        "is_finite",
        "exp",
        "exp2",
        "log",
        "log1p",
        "expm1",
        "tanh",
        "logistic",
        "sin",
        "cos",
        "tan",
        "asin",
        "acos",
        "atan",
        "atan2",
        "sinh",
        "cosh",
        "asinh",
        "acosh",
        "atanh",
        "sqrt",
        "rsqrt",
        "cbrt",
        "abs",
        "square",
        "select_n",
        "clamp",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "and",
        "or",
        "not",
        "xor",
        "convert_element_type",
        "broadcast_in_dim",
        "reshape",
        "squeeze",
        "expand_dims",
        "iota",
        "erf",
        "erfc",
        "erf_inv",
        "lgamma",
        "digamma",
        "nextafter",
        "real",
        "imag",
        "conj",
        "complex",
        "shift_left",
        "shift_right_logical",
        "shift_right_arithmetic",
        "population_count",
        "stop_gradient",
        "copy",
        "copy_p",
        "slice",
        "pad",
        "rev",
        "concatenate",
        "dynamic_slice",
        "reduce_precision",
        "bitcast_convert_type",
    }
)

#: Reductions XLA can fuse their elementwise producers into (the reduce's input is not stored).
REDUCTIONS = frozenset(
    {
        "reduce_sum",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "argmax",
        "argmin",
        "reduce_and",
        "reduce_or",
        "reduce_xor",
    }
)


def needs_operands_in_memory(primitive: str) -> bool:
    """Ops whose operands XLA materializes (library calls, layouts it cannot fuse through)."""
    return primitive not in FUSIBLE and primitive not in REDUCTIONS and primitive != "transpose"


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
