"""Built-in rewrite: a broadcast of a broadcast of a scalar is one broadcast.

``jax.vmap`` broadcasts a value the function made without the batch axis (``jnp.zeros`` in a
layer, a constant fill) to the batch wherever it meets a batched one:
``broadcast_in_dim(broadcast_in_dim(0.0))``. The inner result is a full-size value the split
pass must read whole into every chunk of the batch (a 1.7 MB zero tensor under a 3.8 MB limit),
where one broadcast of the scalar is regenerated per chunk. XLA fuses either form; the composed
one leaves nothing large between the two. Broadcasts of arrays are left as they are (the split
rules read through them, and a chain of them says which axes are new).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from jax import lax

from memsafe._jax import ClosedJaxpr, JaxprEqn, Literal, Var, nbytes_of_aval, source_line
from memsafe.graph import Graph
from memsafe.plan import RuleRecord
from memsafe.rules.tile import Rewrite

NAME = "broadcast_of_broadcast"


def _composed(inner: JaxprEqn, outer: JaxprEqn) -> tuple[int, ...]:
    """Where each axis of ``inner``'s operand lands in ``outer``'s result."""
    dims = outer.params["broadcast_dimensions"]
    return tuple(dims[d] for d in inner.params["broadcast_dimensions"])


def _find_one(graph: Graph, index: int) -> Rewrite | None:
    outer = graph.eqns[index]
    if outer.primitive.name != "broadcast_in_dim" or len(outer.invars) != 1:
        return None
    middle = outer.invars[0]
    if not isinstance(middle, Var):
        return None
    info = graph.info(middle)
    if info.producer is None or len(info.consumers) != 1 or info.is_output:
        return None
    inner = graph.eqns[info.producer]
    if inner.primitive.name != "broadcast_in_dim" or len(inner.invars) != 1:
        return None
    if inner.invars[0].aval.shape != ():
        return None  # a broadcast of an array: the split rules read it through as it is
    source, shape = inner.invars[0], tuple(outer.params["shape"])
    dims = _composed(inner, outer)
    sharding = outer.params.get("sharding")
    detail = f"{middle.aval.dtype}{list(middle.aval.shape)} is no longer made"
    record = RuleRecord(NAME, source_line(outer), nbytes_of_aval(middle.aval), 0, detail)

    def compute(read: Callable[[Any], Any]) -> Any:
        x = source.val if isinstance(source, Literal) else read(source)
        return lax.broadcast_in_dim(x, shape, dims, out_sharding=sharding)

    return Rewrite(index, frozenset({index, info.producer}), compute, record)


def find_rewrites(closed: ClosedJaxpr) -> list[Rewrite]:
    """Broadcasts in ``closed`` whose operand is a broadcast of a scalar only they read, latest
    first."""
    graph = Graph(closed)
    found = (_find_one(graph, i) for i in reversed(range(len(graph.eqns))))
    return [r for r in found if r is not None]


REWRITES = (find_rewrites,)
