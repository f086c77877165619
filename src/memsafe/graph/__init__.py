"""The graph layer: a jaxpr with shapes, bytes and liveness, and the re-tracing interpreter."""

from memsafe.graph.estimate import Estimate, estimate, materialized_values
from memsafe.graph.graph import Graph, ValueInfo
from memsafe.graph.interpret import evaluate, evaluate_eqns, inline_calls, retrace

__all__ = [
    "Estimate",
    "Graph",
    "ValueInfo",
    "estimate",
    "evaluate",
    "evaluate_eqns",
    "inline_calls",
    "materialized_values",
    "retrace",
]
