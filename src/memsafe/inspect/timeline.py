"""The memory timeline: bytes live at each step of XLA's schedule of a compiled program.

The timeline is XLA's own account, not a model: the program is compiled once with
``xla_dump_to`` set to a temporary directory, and the schedule, live ranges and buffer offsets XLA
wrote there are read back (:mod:`memsafe.inspect.buffers`). Memory shared by two values is
counted once, so the peak is what XLA's allocations must hold at once; the temporary allocation
XLA reserves (``memory_analysis().temp_size_in_bytes``) is at least the temporaries' part of it,
more where its heap packing leaves gaps.
"""

from __future__ import annotations

import tempfile
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from memsafe.inspect.buffers import Buffer, DumpError, read_dump
from memsafe.limits import format_bytes

#: The buffer kinds in the order a timeline stacks them.
KINDS = ("parameter", "output", "constant", "temporary")


def _union(intervals: list[tuple[int, int]]) -> int:
    """Bytes covered by ``(offset, end)`` intervals of one allocation."""
    total, reach = 0, -1
    for lo, hi in sorted(intervals):
        if hi <= reach:
            continue
        total += hi - max(lo, reach)
        reach = hi
    return total


def _live_bytes(live: list[Buffer]) -> dict[str, int]:
    """Bytes of the ``live`` buffers by kind, each byte of an allocation counted once."""
    by_slot: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    for b in live:
        by_slot[(b.kind, b.allocation)].append((b.offset, b.offset + b.bytes))
    out = dict.fromkeys(KINDS, 0)
    for (kind, _), intervals in by_slot.items():
        out[kind] += _union(intervals)
    return out


def _sweep(buffers: list[Buffer], count: int) -> tuple[dict[str, int], ...]:
    """Bytes live at each of ``count`` steps (buffers enter at their start, leave after end)."""
    starting: dict[int, list[Buffer]] = defaultdict(list)
    for b in buffers:
        starting[b.start].append(b)
    active: list[Buffer] = []
    out = []
    for step in range(count):
        active = [b for b in active if b.end >= step] + starting.get(step, [])
        out.append(_live_bytes(active))
    return tuple(out)


@dataclass(frozen=True)
class Timeline:
    """Bytes live along the schedule of one compiled program.

    Attributes:
        name: what the program is (``"jax.jit"``, ``"memsafe.jit"``, a function's name).
        steps: the scheduled instructions, one per step (called computations flattened in).
        buffers: every value with its live range, allocation and offset.
        live: bytes live at each step, by kind (``parameter``, ``output``, ``constant``,
            ``temporary``).
    """

    name: str
    steps: tuple[str, ...]
    buffers: tuple[Buffer, ...]
    live: tuple[dict[str, int], ...]

    @classmethod
    def from_buffers(cls, name: str, steps: list[str], buffers: list[Buffer]) -> Timeline:
        """Build the timeline of a schedule and its buffers."""
        count = max([len(steps), *(b.end + 1 for b in buffers)])
        return cls(name, tuple(steps), tuple(buffers), _sweep(buffers, count))

    @property
    def totals(self) -> list[int]:
        """Bytes live at each step, all kinds together."""
        return [sum(v.values()) for v in self.live]

    @property
    def peak_step(self) -> int:
        """The first step at which the most bytes are live."""
        totals = self.totals
        return max(range(len(totals)), key=lambda t: (totals[t], -t)) if totals else 0

    @property
    def peak(self) -> int:
        """The most bytes live at any step."""
        return max(self.totals, default=0)

    def step_name(self, step: int) -> str:
        """The instruction scheduled at ``step`` (``"(end)"`` at the step after the last)."""
        if 0 <= step < len(self.steps):
            return self.steps[step]
        return "(end)" if step == len(self.steps) else ""

    def alive_at(self, step: int) -> list[Buffer]:
        """The buffers live at ``step``, largest first; of values sharing memory, the first."""
        seen: set[tuple[int, int]] = set()
        out = []
        for b in sorted(self.buffers, key=lambda b: (-b.bytes, b.start)):
            if b.live_at(step) and (b.allocation, b.offset) not in seen and b.bytes > 0:
                seen.add((b.allocation, b.offset))
                out.append(b)
        return out

    def describe(self) -> str:
        """One line: the peak, where, and what it is made of."""
        at = self.peak_step
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in self.live[at].items() if v)
        where = self.step_name(at)
        return (
            f"{self.name}: peak {format_bytes(self.peak)} at step {at}/{len(self.live) - 1}"
            + (f" ({where})" if where else "")
            + (f": {parts}" if parts else "")
        )

    def __repr__(self) -> str:
        return f"<Timeline {self.describe()}>"


def compile_with_timeline(lowered: Any, name: str) -> tuple[Any, Timeline | None, str]:
    """Compile ``lowered`` (a ``jax.stages.Lowered``) and read its timeline from XLA's dump.

    Args:
        lowered: the program to compile; its own compiler options are kept.
        name: what the timeline calls the program.

    Returns:
        (the compiled program, its timeline or None, why there is none or ``""``).
    """
    with tempfile.TemporaryDirectory(prefix="memsafe-xla-dump-") as directory:
        compiled = lowered.compile(compiler_options={"xla_dump_to": directory})
        try:
            steps, buffers = read_dump(directory)
        except (DumpError, OSError) as err:
            return compiled, None, f"no memory timeline: {err}"
    return compiled, Timeline.from_buffers(name, steps, buffers), ""
