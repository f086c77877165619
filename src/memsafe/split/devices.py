"""What the split's partial results do across devices (inside ``jax.shard_map``, memsafe.mesh):
combined in device order, which is chunk order, so ties and NaN keep the one-device answer; a
monoid whose fold has a collective (:data:`COLLECTIVES`: a sum's ``psum``) folds every device's
partial at once. Reducers know nothing of devices: this module decides. A loop runs over the
devices through a :class:`DevicesRunner` (memsafe.mesh's)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from jax import lax

from memsafe._jax import JaxprEqn
from memsafe.split.loop import Body, Carry, Written
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


@runtime_checkable
class DevicesRunner(Protocol):
    """A chunk-loop runner (``memsafe.split.loop.Runner``) over the devices of a mesh
    (memsafe.mesh.ShardedRun) that also runs any computation over each device's share of the
    axis."""

    @property
    def devices(self) -> int:
        """Devices sharing the axis, each over an equal share."""
        ...

    def __call__(
        self, body: Body, size: int, chunk: int, operands: list[Any], carry: Carry,
        written: Written, axes: Sequence[int | None] = (),
    ) -> tuple[list[Any], list[Any]]: ...  # fmt: skip

    def each(
        self,
        local: Callable[[list[Any], Any], Any],
        size: int,
        operands: list[Any],
        axes: Sequence[int | None],
        carry: Carry,
    ) -> Any:
        """``local(operands on this device, origin)``, a state of ``carry``, on every device
        over its share of positions ``[0, size)`` (``size`` a multiple of :attr:`devices`),
        combined across devices (``memsafe.mesh.combine``)."""
        ...
