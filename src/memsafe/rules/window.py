"""Built-in rewrite: a ``pad`` that only feeds a pooling becomes the pooling's own padding.

The gradient of a pooling that sums (average pooling, ``reduce_window_sum``) pads the cotangent
(zeros around it and ``stride - 1`` zeros between its positions) and sums windows of the padded
value. ``reduce_window`` pads and dilates its operand itself, with its monoid's identity: where
the ``pad`` fills with that identity (0 for sums, -inf for max, +inf for min) and no negative
padding crops, the two are one ``reduce_window`` whose padding is the sum of both and whose
base dilation is the pad's interior plus one. The padded value is never stored, and the split
pass sees one windowed operation over the cotangent, which halos can split
(:mod:`memsafe.split.strategies.halo`) where they could not read through the ``pad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from memsafe._jax import (
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    Var,
    bind_eqn_with,
    nbytes_of_aval,
    source_line,
)
from memsafe.graph import Graph
from memsafe.plan import RuleRecord
from memsafe.rules.tile import Rewrite

NAME = "pad_into_window"

#: The pooling primitives and the value each pads with (its monoid's identity).
_IDENTITY: dict[str, Callable[[Any], Any]] = {
    "reduce_window_sum": lambda dtype: np.zeros((), dtype),
    "reduce_window_max": lambda dtype: _extreme(dtype, low=True),
    "reduce_window_min": lambda dtype: _extreme(dtype, low=False),
}


def _extreme(dtype: Any, low: bool) -> Any:
    if np.issubdtype(dtype, np.floating):
        return np.array(-np.inf if low else np.inf, dtype)
    info = np.iinfo(dtype)
    return np.array(info.min if low else info.max, dtype)


def _fills_identity(pad: JaxprEqn, name: str) -> bool:
    """Whether ``pad`` pads with ``name``'s identity (a literal)."""
    fill = pad.invars[1]
    if not isinstance(fill, Literal):
        return False
    identity = _IDENTITY[name](pad.outvars[0].aval.dtype)
    return bool(np.array_equal(np.asarray(fill.val), identity, equal_nan=False))


def _folded(pad: JaxprEqn, pool: JaxprEqn) -> dict[str, Any] | None:
    """The pooling's padding and base dilation with ``pad`` folded in, or None where they do not
    combine (negative padding; a pooling that dilates an axis the pad fills between)."""
    padding, dilation = [], []
    base = pool.params.get("base_dilation") or (1,) * len(pool.params["padding"])
    pads = zip(pad.params["padding_config"], pool.params["padding"], base)
    for (lo, hi, interior), (p_lo, p_hi), b in pads:
        if min(lo, hi, interior) < 0 or (b != 1 and (lo, hi, interior) != (0, 0, 0)):
            return None
        padding.append((lo + p_lo, hi + p_hi))
        dilation.append(b * (interior + 1))
    return {"padding": tuple(padding), "base_dilation": tuple(dilation)}


def _find_one(graph: Graph, index: int) -> Rewrite | None:
    pool = graph.eqns[index]
    name = pool.primitive.name
    if name not in _IDENTITY or not isinstance(pool.invars[0], Var):
        return None
    operand = pool.invars[0]
    info = graph.info(operand)
    if info.producer is None or len(info.consumers) != 1 or info.is_output:
        return None
    pad = graph.eqns[info.producer]
    if pad.primitive.name != "pad" or not _fills_identity(pad, name):
        return None
    params = _folded(pad, pool)
    if params is None:
        return None
    source = pad.invars[0]
    detail = f"padded {operand.aval.dtype}{list(operand.aval.shape)} is no longer stored"
    record = RuleRecord(NAME, source_line(pool), nbytes_of_aval(operand.aval), 0, detail)

    def compute(read: Callable[[Any], Any]) -> Any:
        (out,) = bind_eqn_with(pool, [read(source)], **params)
        return out

    return Rewrite(index, frozenset({index, info.producer}), compute, record)


def find_rewrites(closed: ClosedJaxpr) -> list[Rewrite]:
    """Poolings in ``closed`` whose operand is a ``pad`` that only they read, latest first."""
    graph = Graph(closed)
    found = (_find_one(graph, i) for i in reversed(range(len(graph.eqns))))
    return [r for r in found if r is not None]


REWRITES = (find_rewrites,)
