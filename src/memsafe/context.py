"""What every pass sees beside the program: the limit, the plan it records into, and the share of
the budget the remat and roll passes agree on. The split planner (:mod:`memsafe.split.program`)
reads it too."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memsafe.errors import Blocker
from memsafe.plan import Plan, Record


@dataclass
class PassContext:
    """Shared state of one run of the pipeline.

    ``memory_limit`` is the whole-program limit in bytes; ``fixed_bytes`` what arguments, outputs
    and constants take regardless of rewriting; ``chunk_scale`` (<= 1) is lowered by the driver when
    a verified compile still exceeds the limit, so size-choosing passes pick smaller pieces.
    ``keep_custom_derivatives``: rewrites keep the custom derivative rules their replacements
    carry (the program is to be differentiated); otherwise only their primal computation is kept.
    ``mesh``: where set (a :class:`memsafe.split.strategies.sharded.mesh.Sharding`), the split pass
    shards the axis of each top-level region over its devices, and the limit is per device.
    ``roll``: whether the roll pass may turn repeated blocks into scans (the driver plans the
    program as written again, without, when no rolled attempt fits).
    ``floored_held``: the split pass may take a split of values held whole beside the loop
    at chunks the size model expects over the budget (floored, see
    :func:`memsafe.split.planner.best_split`). Such a split is a guess that can cost a loop per
    position, so the driver allows it only once an attempt at a shrunk chunk scale was over
    the limit (:meth:`memsafe.search.Search.attempts`); ``held_declined`` says that the split pass
    found such a split and did not take it (the driver makes the attempt again with them).
    ``held``: the split pass may measure the values a region holds whole against the room
    where the chunk-scaled budget splits a candidate no other way (the retry of
    :func:`memsafe.split.planner.best_split`); ``held_taken`` says that it did (the driver plans
    again without it when no attempt fits, :meth:`memsafe.search.Search.run`).
    """

    memory_limit: int
    fixed_bytes: int
    plan: Plan
    chunk_scale: float = 1.0
    keep_custom_derivatives: bool = False
    mesh: Any = None
    roll: bool = True
    floored_held: bool = False
    held_declined: bool = False
    held: bool = True
    held_taken: bool = False
    blockers: list[Blocker] = field(default_factory=list)

    def decline_held(self) -> None:
        """Note that a floored split of held values was found and not taken
        (``held_declined``)."""
        self.held_declined = True

    @property
    def temp_budget(self) -> int:
        """Bytes left for temporaries once arguments, outputs and constants are placed."""
        return int(self.room * self.chunk_scale)

    @property
    def room(self) -> int:
        """Bytes left for temporaries, not scaled by ``chunk_scale``: what fits at all."""
        return max(0, self.memory_limit - self.fixed_bytes)

    def record(self, rec: Record) -> None:
        self.plan.records.append(rec)

    def block(self, blocker: Blocker) -> None:
        if blocker not in self.blockers:
            self.blockers.append(blocker)
