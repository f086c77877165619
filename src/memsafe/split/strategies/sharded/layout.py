"""Which mesh axes a sharded split loops over, and which are left to XLA's partitioner.

On a mesh with several axes (say ``("q", "d")`` of 2 x 4), a split region's axis need not run
over every device. The axis can be sharded over some mesh axes (the *manual* ones, where each
device loops over its share in ``jax.shard_map`` and the sinks are combined across them) while
the other mesh axes (the *batch* ones) split each value the region reads whole, along its
longest axis they divide; inside the loop XLA's SPMD partitioner runs each device's part of
those values. For a kNN whose loop runs over the queries, the queries run over one mesh axis
and the database is split over the other.

The layout is the one whose per-device share of the region's outside values is least: the
values the loop slices divided by the manual devices, the values read whole divided by the
batch devices where they divide one of its axes. Ties go to more manual devices (every axis
manual, the one-axis layout, when nothing is read whole). The verifying compile decides, as for
every plan, whether the program fits.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jax.sharding import Mesh

from memsafe.graph import Graph


@dataclass(frozen=True)
class Layout:
    """Mesh axes a split's axis runs over (``manual``) and those splitting its whole inputs."""

    mesh: Mesh
    manual: tuple[str, ...]

    @property
    def batch(self) -> tuple[str, ...]:
        """The mesh axes left to XLA's partitioner (they split inputs read whole)."""
        return tuple(n for n in self.mesh.axis_names if n not in self.manual)

    @property
    def devices(self) -> int:
        """Devices the split axis is sharded over."""
        return _size(self.mesh, self.manual)

    @property
    def batch_devices(self) -> int:
        return _size(self.mesh, self.batch)


def _size(mesh: Mesh, names: Sequence[str]) -> int:
    return math.prod(int(mesh.shape[n]) for n in names)


def batch_axis(shape: Sequence[int], devices: int) -> int | None:
    """The longest axis of ``shape`` that ``devices`` divide (the first among equals); None
    when there is none or ``devices`` is 1."""
    if devices < 2:
        return None
    fits = [a for a, n in enumerate(shape) if n % devices == 0 and n >= devices]
    return max(fits, key=lambda a: shape[a], default=None)


def choose(graph: Graph, region: Any, mesh: Mesh) -> Layout:
    """The layout of ``region``'s loop on ``mesh`` (see the module's docstring).

    Args:
        graph: the program the region belongs to.
        region: the split region (its ``sliced`` and ``whole`` outside values, ``size``).
        mesh: the mesh the program runs on.

    Returns:
        The layout with the least per-device input bytes, whose manual devices are at most the
        axis's size.
    """
    sliced = sum(graph.info(v).bytes for v in region.sliced)
    whole = list(region.whole)
    names = tuple(mesh.axis_names)
    options = [
        Layout(mesh, manual)
        for k in range(1, len(names) + 1)
        for manual in itertools.combinations(names, k)
        if _size(mesh, manual) <= region.size
    ]

    def cost(layout: Layout) -> tuple[float, int]:
        per = sliced / layout.devices
        for v in whole:
            split = batch_axis(v.aval.shape, layout.batch_devices) is not None
            per += graph.info(v).bytes / (layout.batch_devices if split else 1)
        return per, -layout.devices

    return min(options, key=cost, default=Layout(mesh, names))
