"""XLA's buffer assignment, read from the files ``xla_dump_to`` writes for one compile.

Two files are read, both printed by XLA after optimization:

- ``*-live-range.txt``: the schedule (``InstructionSequence``, one instruction per time step,
  called computations flattened in) and each value's live range ``name{index}:start-end``;
- ``*-buffer-assignment.txt``: the allocations (parameter, output, constant, thread-local or
  temporary) and, for each value, the allocation and offset it occupies.

Two values that share memory (an elementwise kernel writing over an input that dies there, a
loop's carried buffer) have the same allocation and offset, so bytes are counted once per byte of
memory, as XLA allocates them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

#: Allocation kinds by the words XLA prints after ``allocation N: size S,`` (first match wins).
_KINDS: tuple[tuple[str, str], ...] = (
    ("thread-local", "thread-local"),
    ("parameter", "parameter"),
    ("output shape", "output"),
    ("maybe-live-out", "output"),
    ("constant", "constant"),
)

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*)$")
_VALUE = re.compile(r"^\s*value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_STEP = re.compile(r"^\s*(\d+):(\S+)\s*$")
_RANGE = re.compile(r"^\s*(\S+):(\d+)-(\d+)\s*$")
_MAX = re.compile(r"HloLiveRange \(max (\d+)\)")


class DumpError(ValueError):
    """XLA's dump lacks a file or prints it in a form this reader does not know."""


@dataclass(frozen=True)
class Buffer:
    """One HLO value in memory: where it lives and when.

    Attributes:
        name: the value, ``instruction`` or ``instruction{i}`` for element ``i`` of a tuple.
        bytes: its size.
        start: the first schedule step it is live at.
        end: the last schedule step it is live at (inclusive).
        kind: ``parameter``, ``output``, ``constant`` or ``temporary``.
        allocation: XLA's allocation index; with ``offset``, where its bytes are.
        offset: its offset in the allocation.
        shape: its HLO shape, e.g. ``f32[2000,20000]{1,0}``.
    """

    name: str
    bytes: int
    start: int
    end: int
    kind: str
    allocation: int
    offset: int
    shape: str

    @property
    def instruction(self) -> str:
        """The HLO instruction that defines the value."""
        return self.name.split("{", 1)[0]

    def live_at(self, step: int) -> bool:
        return self.start <= step <= self.end


def _plain(name: str) -> str:
    """``x.1{}`` -> ``x.1``: the buffer assignment prints a non-tuple value without ``{}``."""
    return name[:-2] if name.endswith("{}") else name


def parse_live_range(text: str) -> tuple[list[str], dict[str, tuple[int, int]], int]:
    """The schedule, each value's live range and the last step, from ``*-live-range.txt``.

    Args:
        text: the file's content.

    Returns:
        (instruction names in schedule order, value name -> (start, end), last step).
    """
    found = _MAX.search(text)
    if not found:
        raise DumpError("no 'HloLiveRange (max N)' header in XLA's live-range dump")
    steps: list[str] = []
    ranges: dict[str, tuple[int, int]] = {}
    section = ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith(":") and not _RANGE.match(stripped):
            section = stripped
            continue
        if section == "InstructionSequence:" and (m := _STEP.match(line)):
            steps.append(m.group(2))
        elif section == "BufferLiveRange:" and (m := _RANGE.match(line)):
            ranges[_plain(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    return steps, ranges, int(found.group(1))


def _kind(description: str) -> str:
    for words, kind in _KINDS:
        if words in description:
            return kind
    return "temporary"


def parse_buffer_assignment(text: str) -> list[tuple[str, int, int, int, str, str]]:
    """Each value's (name, bytes, allocation, offset, kind, shape) from ``*-buffer-assignment.txt``.

    Thread-local allocations (a reducer's scalars) are left out: they are not part of the
    program's buffers.
    """
    values: list[tuple[str, int, int, int, str, str]] = []
    allocation, kind = -1, ""
    for line in text.splitlines():
        if m := _ALLOCATION.match(line):
            allocation, kind = int(m.group(1)), _kind(m.group(3))
        elif (m := _VALUE.match(line)) and allocation >= 0 and kind != "thread-local":
            name, size, offset = _plain(m.group(1)), int(m.group(2)), int(m.group(3))
            values.append((name, size, allocation, offset, kind, m.group(4).strip()))
    if allocation < 0:
        raise DumpError("no 'allocation N: size S' line in XLA's buffer-assignment dump")
    return values


def read_buffers(live_range: str, assignment: str) -> tuple[list[str], list[Buffer]]:
    """The schedule and every buffer with its live range.

    A value the live-range file does not list is taken as live for the whole program (the safe
    side: it is never left out of the peak).
    """
    steps, ranges, last = parse_live_range(live_range)
    buffers = []
    for name, size, allocation, offset, kind, shape in parse_buffer_assignment(assignment):
        start, end = ranges.get(name, (0, last))
        buffers.append(Buffer(name, size, start, end, kind, allocation, offset, shape))
    return steps, buffers


def _one(directory: Path, suffix: str) -> str:
    found = sorted(directory.glob(f"*after_optimizations{suffix}"))
    if not found:
        raise DumpError(f"XLA wrote no '*after_optimizations{suffix}' to {directory}")
    return found[-1].read_text(encoding="utf-8", errors="replace")


def read_dump(directory: str | Path) -> tuple[list[str], list[Buffer]]:
    """The schedule and buffers of the one module XLA dumped to ``directory``."""
    path = Path(directory)
    return read_buffers(_one(path, "-live-range.txt"), _one(path, "-buffer-assignment.txt"))
