"""What the split's partial results do across devices (inside ``jax.shard_map``,
memsafe.split.strategies.sharded.mesh): combined in device order, which is chunk order, so ties and
NaN keep the one-device answer; a monoid whose fold has a collective (:data:`COLLECTIVES`: a sum's
``psum``) folds every device's partial at once. Reducers know nothing of devices: this module
decides. A loop runs over the devices through a ``memsafe.split.loop.DevicesRunner`` (:mod:`.mesh`'s
``ShardedRun``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jax import lax

from memsafe._jax import JaxprEqn
from memsafe.split.sinks import Monoid, Partial, Reducer

#: The collective that folds the partials of every device at once, by a monoid's fold (its
#: ``op``). max and min are gathered and folded instead: lax.pmax and lax.pmin drop NaN on the
#: CPU.
COLLECTIVES: dict[Any, Any] = {lax.add: lax.psum}


def collective(reducer: Reducer) -> Any:
    """The collective that combines ``reducer``'s partials across devices, ``(partial,
    axis_name) -> combined`` (:data:`COLLECTIVES`), or None where they are gathered and folded
    in device order."""
    return COLLECTIVES.get(reducer.op) if isinstance(reducer, Monoid) else None


def combine_partials(reducer: Reducer, eqn: JaxprEqn, part: Partial, axis_name: Any) -> Partial:
    """A sink's partials of every device along mesh axis ``axis_name`` combined in device order:
    by its :func:`collective` where it has one, else gathered and folded as consecutive chunks,
    so ties and NaN keep the one-device answer."""
    combined = collective(reducer)
    if combined is not None:
        return tuple(combined(p, axis_name) for p in part)
    gathered = [lax.all_gather(p, axis_name) for p in part]
    acc = tuple(g[0] for g in gathered)
    for d in range(1, gathered[0].shape[0]):
        acc = reducer.fold(eqn, acc, tuple(g[d] for g in gathered))
    return acc


@dataclass(frozen=True)
class DeviceAxis:
    """What a running rule's ``across`` (``memsafe.split.strategies.sharded.mesh.Shardable``) is
    given, inside ``jax.shard_map``: the mesh axis the devices ran their shares of the split axis
    along (``name``, for collectives such as ``lax.psum``), and :meth:`fold`."""

    name: Any

    def fold(self, reducer: Reducer, eqn: JaxprEqn, part: Partial) -> Partial:
        """Every device's ``part`` combined by ``reducer`` in device order
        (:func:`combine_partials`)."""
        return combine_partials(reducer, eqn, part, self.name)
