"""What an inspection report is made of: kernels, arrays, loops, constants and findings.

All sizes are bytes, read from HLO shapes; ``dtype`` is HLO's element type name (``f32``, ``s32``,
``c64``, ``pred``...), so a shape prints as ``f32[2000,20000]``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memsafe.inspect.hlo import Shape, Source
from memsafe.limits import format_bytes


@dataclass
class Kernel:
    """One kernel XLA launches: a fusion (with its kind) or an unfused op (dot, fft, while...)."""

    name: str
    opcode: str
    kind: str | None  # fusion kind: kLoop, kInput, kOutput, kCustom; None if not a fusion
    shape: Shape
    inputs: list[str]  # names of the arrays it reads
    outputs: list[str]  # names of the arrays it writes
    computation: str
    order: int  # position in its computation's schedule
    ops: tuple[str, ...] = ()  # opcodes fused inside (or the op itself)
    sources: tuple[Source, ...] = ()  # the user's lines it came from, most frequent first
    target: str | None = None  # custom-call target or FFT type
    parent: str | None = None  # the while/conditional kernel whose body holds it

    @property
    def bytes(self) -> int:
        """Bytes of what the kernel writes."""
        return self.shape.bytes

    @property
    def loop(self) -> str | None:
        return self.parent

    @property
    def where(self) -> str:
        return str(self.sources[0]) if self.sources else ""

    @property
    def label(self) -> str:
        if self.opcode == "fusion":
            return f"fusion ({self.kind})" if self.kind else "fusion"
        if self.target:
            return f"{self.opcode} {self.target}"
        return self.opcode


@dataclass
class Array:
    """A buffer between kernels, a parameter, an output, a constant or a loop's carried state."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    producer: str | None  # kernel name; None for parameters and constants
    consumers: list[str] = field(default_factory=list)
    role: str = "temporary"  # parameter, output, temporary, constant, loop state
    computation: str = ""
    parent: str | None = None  # the loop whose body holds it
    source: Source | None = None

    @property
    def type(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"

    def describe(self) -> str:
        return f"{self.name} {self.type} ({format_bytes(self.bytes)})"


@dataclass
class LoopState:
    """One element of a while loop's carried tuple."""

    index: int
    array: str  # the state array (the loop's buffer)
    init: list[str]  # the arrays it starts from, outside the loop
    update: list[str]  # the arrays the body writes back
    bytes: int
    invariant: bool  # the body passes it through unchanged


@dataclass
class Loop:
    name: str
    body: str
    condition: str
    trip_count: int | None
    state: list[LoopState] = field(default_factory=list)
    parent: str | None = None

    @property
    def bytes(self) -> int:
        return sum(s.bytes for s in self.state)


@dataclass
class Constant:
    """An array constant: folded into the executable or passed by JAX as a hidden argument."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    bytes: int
    kind: str  # "folded" (an HLO constant) or "hidden" (a closed-over array passed as argument)
    counted: bool  # whether memory_analysis() counts it
    where: str = ""
    closed_over: bool = False  # it comes from an array the function closed over

    @property
    def type(self) -> str:
        return f"{self.dtype}[{','.join(str(d) for d in self.shape)}]"


@dataclass
class Finding:
    """A rule of thumb that applies to the compiled program, with the bytes it costs."""

    rule: str
    bytes: int
    message: str  # what was seen
    advice: str  # what to do
    where: str = ""  # the user's source line
    kernels: tuple[str, ...] = ()
    arrays: tuple[str, ...] = ()
    fixed_by_memsafe_jit: bool | None = None

    def describe(self) -> str:
        loc = f" at {self.where}" if self.where else ""
        return f"[{self.rule}] {format_bytes(self.bytes)}{loc}: {self.message} {self.advice}"
