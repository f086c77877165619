"""What memsafe.jit did to a program: rules fired, splits, scheduling, and footprints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memsafe.limits import format_bytes
from memsafe.xla import Footprint


@dataclass(frozen=True)
class RuleRecord:
    """A match-and-replace or reordering rewrite that fired."""

    rule: str
    where: str
    bytes_saved: int = 0
    flops_saved: int = 0
    detail: str = ""

    def describe(self) -> str:
        saved = f"saves {format_bytes(self.bytes_saved)}, {self.flops_saved:.3g} flops"
        return f"rule {self.rule} at {self.where or '?'}: {saved}. {self.detail}".rstrip(". ")


@dataclass(frozen=True)
class SplitRecord:
    """One region run in sequential chunks."""

    value: (
        str  # the large value the split removes, e.g. "f32[2000,200000] (reduce_sum at knn.py:12)"
    )
    bytes: int
    axis: int  # axis of ``value`` that is chunked
    size: int  # full extent of that axis
    chunk: int
    loops: int  # number of chunks (loop trip count, remainder included)
    ops: tuple[str, ...]  # primitives inside the loop body
    sinks: tuple[str, ...] = ()  # how the axis is consumed: "reduce_sum", "top_k", "output", ...
    where: str = ""

    def describe(self) -> str:
        return (
            f"split {self.value} ({format_bytes(self.bytes)}) along axis {self.axis} "
            f"(size {self.size}) into {self.loops} chunks of {self.chunk}; sinks: "
            f"{', '.join(self.sinks) or '-'}; ops: {', '.join(self.ops)}"
        )


@dataclass(frozen=True)
class PassRecord:
    """Anything else a pass did (scheduling, recomputation, constants)."""

    pass_name: str
    description: str
    where: str = ""
    bytes_saved: int = 0
    data: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        loc = f" at {self.where}" if self.where else ""
        return f"{self.pass_name}{loc}: {self.description}"


Record = RuleRecord | SplitRecord | PassRecord

#: How a memsafe function can be differentiated, the last line of every plan's text.
DIFFERENTIATION = (
    "differentiation: reverse mode (jax.grad, jax.vjp, jax.jacrev) runs a backward program "
    "verified under the same limit; forward mode (jax.jvp, jax.jacfwd, jax.linearize) does not "
    "go through a memsafe function: apply memsafe.jit to the function that calls jax.jvp"
)


@dataclass
class Attempt:
    """One compile-and-verify round of the driver."""

    chunk_scale: float
    footprint: Footprint | None
    fits: bool
    note: str = ""


@dataclass
class Plan:
    """The driver's account of one program (one set of argument shapes)."""

    memory_limit: int
    before: Footprint | None = None
    after: Footprint | None = None
    fits_unchanged: bool = False
    records: list[Record] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    backward: Plan | None = None

    @property
    def rules(self) -> list[RuleRecord]:
        return [r for r in self.records if isinstance(r, RuleRecord)]

    @property
    def splits(self) -> list[SplitRecord]:
        return [r for r in self.records if isinstance(r, SplitRecord)]

    @property
    def passes(self) -> list[PassRecord]:
        return [r for r in self.records if isinstance(r, PassRecord)]

    def __str__(self) -> str:
        lines = [f"memsafe plan (limit {format_bytes(self.memory_limit)})"]
        if self.before is not None:
            lines.append(f"  before: {self.before.describe()}")
        if self.fits_unchanged:
            lines.append("  fits unchanged: the original program runs as is")
        for rec in self.records:
            lines.append("  " + rec.describe())
        if self.after is not None and not self.fits_unchanged:
            lines.append(f"  after:  {self.after.describe()}")
        if len(self.attempts) > 1:
            lines.append(f"  verified after {len(self.attempts)} compile attempts")
        lines.append(f"  {DIFFERENTIATION}")
        return "\n".join(lines)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython
        p.text(str(self))
