"""What findings and renderings read of a report, as a protocol.

:class:`memsafe.inspect.report.Report` satisfies it; ``findings`` and ``render`` depend on this
protocol rather than on the report module, so imports go one way: report -> findings, render ->
view -> graph, model.
"""

from __future__ import annotations

from typing import Protocol

from memsafe.inspect.graph import ProgramGraph
from memsafe.inspect.model import Array, Constant, Finding, Kernel, Loop
from memsafe.inspect.timeline import Timeline
from memsafe.plan import Plan
from memsafe.xla import Footprint


class ReportView(Protocol):
    """A compiled program's kernels, arrays, loops, constants, footprint and findings."""

    name: str
    arguments: list[str]
    mode: str
    kernels: list[Kernel]
    arrays: list[Array]
    loops: list[Loop]
    constants: list[Constant]
    footprint: Footprint
    peak_memory_in_bytes: int | None
    graph: ProgramGraph
    findings: list[Finding]
    timeline: Timeline | None
    memsafe_timeline: Timeline | None
    notes: list[str]
    plan: Plan | None

    @property
    def temporaries(self) -> list[Array]:
        """Arrays between kernels, largest first."""
        ...

    @property
    def timelines(self) -> list[Timeline]:
        """The plain program's timeline, then memsafe.jit's when there is one."""
        ...
