"""What the split's partial results do across devices (inside ``jax.shard_map``, memsafe.mesh):
combined in device order, which is chunk order, so ties and NaN keep the one-device answer."""

from __future__ import annotations

from typing import Any

from jax import lax

from memsafe._jax import JaxprEqn
from memsafe.split.sinks import Monoid, Partial, Reducer


def combine_partials(reducer: Reducer, eqn: JaxprEqn, part: Partial, axis_name: Any) -> Partial:
    """A sink's partials of every device along mesh axis ``axis_name`` combined in device order:
    a monoid's collective where it has one, else gathered and folded as consecutive chunks, so
    ties and NaN keep the one-device answer."""
    if isinstance(reducer, Monoid) and reducer.collective is not None:
        return tuple(reducer.collective(p, axis_name) for p in part)
    gathered = [lax.all_gather(p, axis_name) for p in part]
    acc = tuple(g[0] for g in gathered)
    for d in range(1, gathered[0].shape[0]):
        acc = reducer.fold(eqn, acc, tuple(g[d] for g in gathered))
    return acc
