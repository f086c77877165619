"""A parser of XLA's optimized HLO text (``compiled.as_text()``).

jaxlib's Python HLO classes are private and move between releases; the text format is what every
release prints. This module reads the parts the inspector needs: computations and their
instructions, shapes (with tuples), operands, fusion kinds, called computations (fusion bodies,
while bodies and conditions, reducers) and the user's source lines from HLO metadata, both the old
``source_file=/source_line=`` form and the newer ``stack_frame_id`` tables.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

#: Bytes per element of HLO primitive types (sub-byte types are rounded up per array).
DTYPE_BITS: dict[str, int] = {
    "pred": 8,
    "s2": 2,
    "u2": 2,
    "s4": 4,
    "u4": 4,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "s32": 32,
    "u32": 32,
    "s64": 64,
    "u64": 64,
    "f16": 16,
    "bf16": 16,
    "f32": 32,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,
    "opaque": 0,
}


@dataclass(frozen=True)
class Shape:
    """An HLO shape: an array (``dtype``, ``dims``, ``layout``) or a tuple of shapes."""

    dtype: str
    dims: tuple[int, ...] = ()
    layout: tuple[int, ...] | None = None
    elements: tuple[Shape, ...] | None = None

    @property
    def is_tuple(self) -> bool:
        return self.elements is not None

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> int:
        """Bytes of the array, or the sum over a tuple's elements."""
        if self.elements is not None:
            return sum(e.bytes for e in self.elements)
        bits = DTYPE_BITS.get(self.dtype)
        if bits is None:  # f8 variants and other exotic types: read the width from the name
            digits = re.sub(r"\D", "", self.dtype.split("e")[0]) or "32"
            bits = int(digits)
        return (self.size * bits + 7) // 8

    def __str__(self) -> str:
        if self.elements is not None:
            return "(" + ", ".join(str(e) for e in self.elements) + ")"
        return f"{self.dtype}[{','.join(str(d) for d in self.dims)}]"


@dataclass(frozen=True)
class Source:
    """A user's source location from HLO metadata, innermost frame first in ``stack``."""

    file: str
    line: int
    function: str = ""

    def __str__(self) -> str:
        fn = f" ({self.function})" if self.function else ""
        return f"{self.file}:{self.line}{fn}"


@dataclass
class Instruction:
    """One HLO instruction: ``[ROOT] %name = shape opcode(operands), attributes``."""

    name: str
    shape: Shape
    opcode: str
    operands: list[str]
    attributes: str
    computation: str
    is_root: bool = False
    literal: str = ""  # the text between the parentheses of a constant or parameter
    op_name: str = ""
    stack: tuple[Source, ...] = ()

    @property
    def source(self) -> Source | None:
        """The innermost frame of the user's code (frozen stdlib frames such as ``<frozen
        runpy>`` skipped), or None."""
        for frame in self.stack:
            if not frame.file.startswith("<frozen "):
                return frame
        return None

    def attr(self, key: str) -> str | None:
        """A plain attribute value such as ``kind`` or ``fft_type`` (None if absent)."""
        match = re.search(rf"(?:^|[,\s]){re.escape(key)}=([^,\s{{}}]+)", self.attributes)
        return match.group(1).strip('"') if match else None

    def called(self, key: str) -> list[str]:
        """Computations named by ``key=%c`` or ``key={%a, %b}``."""
        match = re.search(
            rf"(?:^|[,\s]){re.escape(key)}=(\{{[^}}]*\}}|%?[\w.\-]+)", self.attributes
        )
        if not match:
            return []
        return [n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", match.group(1).strip("{}"))]

    def int_list(self, key: str) -> tuple[int, ...]:
        """An attribute such as ``dimensions={1,2}`` as a tuple of ints."""
        match = re.search(rf"(?:^|[,\s]){re.escape(key)}=\{{([^}}]*)\}}", self.attributes)
        if not match:
            return ()
        return tuple(int(v) for v in re.findall(r"-?\d+", match.group(1)))

    @property
    def fusion_kind(self) -> str | None:
        return self.attr("kind") if self.opcode == "fusion" else None

    @property
    def backend_config(self) -> str:
        idx = self.attributes.find("backend_config=")
        return self.attributes[idx:] if idx >= 0 else ""


@dataclass
class Computation:
    name: str
    is_entry: bool
    instructions: list[Instruction] = field(default_factory=list)

    @property
    def root(self) -> Instruction:
        for inst in self.instructions:
            if inst.is_root:
                return inst
        return self.instructions[-1]

    def by_name(self) -> dict[str, Instruction]:
        return {i.name: i for i in self.instructions}


@dataclass
class HloModule:
    """A parsed HLO module; ``computations`` keep the order (the schedule) of the text."""

    name: str
    computations: dict[str, Computation]
    entry: str

    @property
    def entry_computation(self) -> Computation:
        return self.computations[self.entry]


class HloParseError(ValueError):
    """The text is not HLO this parser understands."""


# -- shapes -------------------------------------------------------------------------------------

_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([0-9,\s]*)\](\{[^}]*\})?")


def parse_shape(text: str) -> tuple[Shape, int]:
    """Parse one shape at the start of ``text``; returns it and the number of characters read."""
    pos = 0
    while pos < len(text) and text[pos] == " ":
        pos += 1
    if text.startswith("/*", pos):  # tuple index comments: /*index=5*/
        pos = text.index("*/", pos) + 2
        return _shift(parse_shape(text[pos:]), pos)
    if pos < len(text) and text[pos] == "(":
        pos += 1
        elements: list[Shape] = []
        while True:
            while pos < len(text) and text[pos] in " ,":
                pos += 1
            if pos < len(text) and text[pos] == ")":
                return Shape("tuple", elements=tuple(elements)), pos + 1
            shape, used = parse_shape(text[pos:])
            elements.append(shape)
            pos += used
    match = _ARRAY_RE.match(text, pos)
    if not match:
        if text.startswith("token[]", pos):
            return Shape("token"), pos + 7
        raise HloParseError(f"cannot read an HLO shape at: {text[pos : pos + 60]!r}")
    dims_text = match.group(2).strip()
    dims = tuple(int(d) for d in dims_text.split(",")) if dims_text else ()
    layout = None
    if match.group(3):
        minor = match.group(3)[1:-1].split(":")[0]
        layout = tuple(int(v) for v in re.findall(r"\d+", minor))
    return Shape(match.group(1), dims, layout), match.end()


def _shift(result: tuple[Shape, int], offset: int) -> tuple[Shape, int]:
    return result[0], result[1] + offset


# -- metadata -----------------------------------------------------------------------------------


@dataclass
class _Frames:
    files: dict[int, str] = field(default_factory=dict)
    functions: dict[int, str] = field(default_factory=dict)
    locations: dict[int, tuple[int, int, int]] = field(default_factory=dict)  # file, fn, line
    frames: dict[int, tuple[int, int]] = field(default_factory=dict)  # location, parent

    def stack(self, frame_id: int) -> tuple[Source, ...]:
        out: list[Source] = []
        seen: set[int] = set()
        while frame_id in self.frames and frame_id not in seen:
            seen.add(frame_id)
            loc_id, parent = self.frames[frame_id]
            if loc_id in self.locations:
                file_id, fn_id, line = self.locations[loc_id]
                out.append(
                    Source(self.files.get(file_id, "?"), line, self.functions.get(fn_id, ""))
                )
            # The text prints a frame's parent as (parent id + 1), 0 meaning none; a parent that
            # is not an earlier frame is read as "no parent".
            parent_id = parent - 1
            if parent_id <= 0 or parent_id >= frame_id:
                break
            frame_id = parent_id
        return tuple(out)


_TABLES = ("FileNames", "FunctionNames", "FileLocations", "StackFrames")


def _parse_tables(lines: list[str]) -> _Frames:
    frames = _Frames()
    table = None
    for line in lines:
        stripped = line.strip()
        if stripped in _TABLES:
            table = stripped
            continue
        if not stripped or not stripped[0].isdigit():
            if stripped:
                table = None
            continue
        key_text, _, rest = stripped.partition(" ")
        key = int(key_text)
        if table == "FileNames":
            frames.files[key] = rest.strip().strip('"')
        elif table == "FunctionNames":
            frames.functions[key] = rest.strip().strip('"')
        elif table == "FileLocations":
            fields = dict(re.findall(r"(\w+)=(\d+)", rest))
            frames.locations[key] = (
                int(fields.get("file_name_id", 0)),
                int(fields.get("function_name_id", 0)),
                int(fields.get("line", 0)),
            )
        elif table == "StackFrames":
            fields = dict(re.findall(r"(\w+)=(\d+)", rest))
            frames.frames[key] = (
                int(fields.get("file_location_id", 0)),
                int(fields.get("parent_frame_id", 0)),
            )
    return frames


def _metadata(attributes: str, frames: _Frames) -> tuple[str, tuple[Source, ...]]:
    match = re.search(r"metadata=\{([^{}]*)\}", attributes)
    if not match:
        return "", ()
    meta = match.group(1)
    op = re.search(r'op_name="([^"]*)"', meta)
    op_name = op.group(1) if op else ""
    file = re.search(r'source_file="([^"]*)"', meta)
    line = re.search(r"source_line=(\d+)", meta)
    if file and line:
        return op_name, (Source(file.group(1), int(line.group(1))),)
    frame = re.search(r"stack_frame_id=(\d+)", meta)
    if frame:
        return op_name, frames.stack(int(frame.group(1)))
    return op_name, ()


# -- instructions -------------------------------------------------------------------------------

_HEADER_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_INST_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*")


def _matching_paren(text: str, start: int) -> int:
    """Index of the parenthesis closing the one at ``start`` (braces and strings respected)."""
    depth = 0
    in_string = False
    i = start
    while i < len(text):
        ch = text[i]
        if in_string:
            if ch == "\\":
                i += 2
                continue
            if ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "({":
            depth += 1
        elif ch in ")}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise HloParseError(f"unbalanced parentheses in: {text[:80]!r}")


def _parse_instruction(line: str, computation: str, frames: _Frames) -> Instruction:
    match = _INST_RE.match(line)
    if not match:
        raise HloParseError(f"cannot read an HLO instruction: {line[:80]!r}")
    rest = line[match.end() :]
    shape, used = parse_shape(rest)
    rest = rest[used:].lstrip()
    op_match = re.match(r"([\w\-]+)\(", rest)
    if not op_match:
        raise HloParseError(f"cannot read the opcode of: {line[:80]!r}")
    opcode = op_match.group(1)
    open_at = op_match.end() - 1
    close_at = _matching_paren(rest, open_at)
    inner = rest[open_at + 1 : close_at]
    attributes = rest[close_at + 1 :].lstrip(", ")
    literal = ""
    if opcode in ("constant", "parameter"):
        operands: list[str] = []
        literal = inner
    else:
        operands = [n.lstrip("%") for n in re.findall(r"%[\w.\-]+", inner)]
    op_name, stack = _metadata(attributes, frames)
    return Instruction(
        name=match.group(2),
        shape=shape,
        opcode=opcode,
        operands=operands,
        attributes=attributes,
        computation=computation,
        is_root=bool(match.group(1)),
        literal=literal,
        op_name=op_name,
        stack=stack,
    )


def parse_hlo(text: str) -> HloModule:
    """Parse the text of an HLO module (as ``jax.stages.Compiled.as_text()`` prints it)."""
    if not isinstance(text, str) or "HloModule" not in text:
        raise HloParseError("not an HLO module: the text has no 'HloModule' header")
    lines = text.splitlines()
    module_name = (
        lines[0].split()[1].rstrip(",") if lines and lines[0].startswith("HloModule") else ""
    )
    frames = _parse_tables(lines)
    computations: dict[str, Computation] = {}
    entry = ""
    current: Computation | None = None
    for line in lines:
        if current is None:
            header = _HEADER_RE.match(line)
            if header and not line.startswith(" "):
                current = Computation(header.group(2), bool(header.group(1)))
                if current.is_entry:
                    entry = current.name
            continue
        if line.strip() == "}":
            computations[current.name] = current
            current = None
            continue
        if line.strip():
            current.instructions.append(_parse_instruction(line, current.name, frames))
    if not entry:
        raise HloParseError("the HLO module has no ENTRY computation")
    return HloModule(module_name, computations, entry)
