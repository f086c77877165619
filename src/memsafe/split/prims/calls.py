"""Calls. A call whose body maps the split axis through (a ``jax.checkpoint`` region, a nested
``jit``) runs on each chunk: its body re-traced at chunk shape, checkpointed again where it was.

The pipeline inlines the user's calls before planning, so the calls met here are the ones a
split emitted: every chunk loop checkpoints its chunk body, and a later split along another axis
(rows after columns) passes through the first loop's chunk calls as through its ``scan``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from memsafe._jax import ClosedJaxpr, Jaxpr, JaxprEqn, jaxpr_as_fun
from memsafe.graph.interpret import inline_calls
from memsafe.split import body as loop_body
from memsafe.split.registry import Mapping, NoRule, Side, split_rule

#: Call primitives whose body is the parameter ``jaxpr``, and whether the call checkpoints it.
CALLS = {"remat2": True, "checkpoint": True, "pjit": False, "jit": False, "closed_call": False}


@functools.lru_cache(maxsize=64)
def _inlined(sub: Any) -> ClosedJaxpr:
    """A call's body (open or closed) with its own nested calls inlined."""
    closed = sub if isinstance(sub, ClosedJaxpr) else ClosedJaxpr(sub, ())
    return inline_calls(closed)


def _body(eqn: JaxprEqn) -> ClosedJaxpr:
    sub = eqn.params.get("jaxpr")
    if not isinstance(sub, (ClosedJaxpr, Jaxpr)):
        raise NoRule(f"{eqn.primitive.name}: no body to run on a chunk")
    return _inlined(sub)


def _axes(eqn: JaxprEqn, side: Side, axis: int) -> tuple[ClosedJaxpr, dict, dict]:
    body = _body(eqn)
    seeds = {side[1]: axis}
    ins, outs = (seeds, {}) if side[0] == "in" else ({}, seeds)
    axes, maps = loop_body.reach(body.jaxpr, ins, outs)
    return body, axes, maps


def _call(eqn: JaxprEqn, side: Side, axis: int) -> Mapping:
    """Every operand and result of the call at the axis its body value carries."""
    body, axes, _ = _axes(eqn, side, axis)
    ins = tuple(axes.get(v) for v in body.jaxpr.invars)
    outs = tuple(axes.get(v) for v in body.jaxpr.outvars)
    if (ins if side[0] == "in" else outs)[side[1]] != axis:
        raise NoRule(f"{eqn.primitive.name}: the split axis does not pass through the body")
    return Mapping(ins=ins, outs=outs)


def _rebind_call(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """The body re-traced on the chunk (its start as one more operand), checkpointed again
    where the call was a checkpoint."""
    side = next(("in", k) for k, a in enumerate(m.ins) if a is not None)
    body, axes, maps = _axes(eqn, side, m.ins[side[1]])
    in_avals = [v.aval for v in body.jaxpr.invars]
    fun = jaxpr_as_fun(loop_body.chunk_body(body, axes, maps, n, in_avals))
    if CALLS[eqn.primitive.name]:
        fun = jax.checkpoint(
            fun, prevent_cse=eqn.params.get("prevent_cse", True), policy=eqn.params.get("policy")
        )
    return list(fun(jnp.asarray(start, jnp.int32), *invals))


split_rule(*CALLS, rebind=_rebind_call)(_call)
