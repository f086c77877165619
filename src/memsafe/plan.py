"""What memsafe.jit did to a program: rules fired, splits, scheduling, and footprints."""

from __future__ import annotations

import html
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from memsafe.display import fragment, table
from memsafe.limits import format_bytes
from memsafe.sources import shorten_paths
from memsafe.xla import Footprint


def _saves(nbytes: int, flops: int) -> str:
    """``saves 1.2 MiB, 3e+06 flops``; a negative amount is said as what it costs."""
    memory = f"saves {format_bytes(nbytes)}" if nbytes >= 0 else f"costs {format_bytes(-nbytes)}"
    work = f"{flops:.3g} flops" if flops >= 0 else f"{-flops:.3g} more flops"
    return f"{memory}, {work}"


def _collapsed(value: str) -> str:
    """Merged values as ``4 x f32[...] (dot_general at m.py:3) + f32[...] (...)``: a deep
    program's split repeats the same value once per layer."""
    counts = Counter(value.split(" + "))
    return " + ".join(f"{n} x {part}" if n > 1 else part for part, n in counts.items())


@dataclass(frozen=True)
class RuleRecord:
    """A match-and-replace or reordering rewrite that fired."""

    rule: str
    where: str
    bytes_saved: int = 0
    flops_saved: int = 0
    detail: str = ""

    def describe(self) -> str:
        saved = _saves(self.bytes_saved, self.flops_saved)
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
    devices: int = 1  # devices sharing the axis (a mesh); ``loops`` chunks run on each
    share: int = 0  # positions of the axis each device runs (``size`` on one device)
    mesh_axes: tuple[str, ...] = ()  # the mesh axes the devices lie along
    stages: int = 1  # loops over the axis (a staged region runs one per stage)
    recompute_flops: int = 0  # estimated flops later stages spend re-evaluating earlier ones
    batch_mesh_axes: tuple[str, ...] = ()  # other mesh axes, splitting inputs read whole
    floored: bool = False  # the size model expected even the smallest chunk over the budget
    extend: int = 0  # positions each chunk is extended by on both sides (halos), 0: none
    # the size model's numbers behind the chunk (memsafe.split.size.ChunkPlan) and the room,
    # unscaled, it was sized in (PassContext.room): where an attempt's chunks are floored,
    # the search reads from them the chunk scale that gives larger ones (search._floored_up)
    per_unit: int = field(default=0, compare=False, repr=False)
    fixed: int = field(default=0, compare=False, repr=False)
    room: int = field(default=0, compare=False, repr=False)

    def _staging(self) -> str:
        """``; 3 stages recomputing ~2.1e+09 flops``, with the extension of chunks where they
        have halos (nothing for a single loop of plain chunks)."""
        halos = f"; each chunk extended by {self.extend} on both sides" if self.extend else ""
        if self.stages < 2:
            return halos + (f" (~{self.recompute_flops:.2g} flops)" if halos else "")
        return f"{halos}; {self.stages} stages recomputing ~{self.recompute_flops:.2g} flops"

    def describe(self) -> str:
        where = f"(size {self.size}) into {self.loops} chunks of {self.chunk}"
        if self.devices > 1:
            rest = self.size - self.share * self.devices
            extra = f", the last {rest} after them" if rest else ""
            where = (
                f"(size {self.size}) sharded over mesh axes ({', '.join(self.mesh_axes)}): "
                f"{self.devices} devices, {self.share} each{extra}; "
                f"each device runs {self.loops} chunks of {self.chunk}"
            )
            if self.batch_mesh_axes:
                where += (
                    f"; inputs read whole split over mesh axes ({', '.join(self.batch_mesh_axes)})"
                )
        return (
            f"split {_collapsed(self.value)} ({format_bytes(self.bytes)}) along axis {self.axis} "
            f"{where}{self._staging()}; sinks: {', '.join(self.sinks) or '-'}; "
            f"ops: {', '.join(self.ops)}"
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
class PlanTime:
    """Seconds one plan took, by phase (wall clock; the original program compiles in a worker
    thread beside the first attempt, so the phases can add up to more than ``total``).

    Attributes:
        origin: how the program was obtained: "planned", "re-sized" (from the plan of the same
            program at smaller shapes, :class:`memsafe.search.Hint`), "reused" (verified before
            in this process) or "loaded" (from the plan store).
        trace: tracing the function (and the program a rewrite starts from).
        passes: each pass's seconds, summed over the attempts.
        compiles: each XLA compile, as (what, seconds).
        loaded: loading executables stored by another process (:mod:`memsafe.stored`), not
            compiled again.
        held: where the original program was not compiled, the bytes it was known to hold at
            once (:func:`memsafe.graph.held.held_bytes`, over the limit); 0 where it was.
        total: the whole plan, from the call to the verified program.
    """

    origin: str = "planned"
    trace: float = 0.0
    passes: dict[str, float] = field(default_factory=dict)
    compiles: list[tuple[str, float]] = field(default_factory=list)
    loaded: float = 0.0
    held: int = 0
    total: float = 0.0

    def describe(self) -> str:
        """One line: the total and each phase, the slowest passes first."""
        passes = sorted(self.passes.items(), key=lambda kv: -kv[1])
        shown = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in passes[:4])
        compiled = sum(seconds for _, seconds in self.compiles)
        parts = [f"trace {self.trace:.2f} s"]
        if passes:
            parts.append(f"passes {sum(self.passes.values()):.2f} s ({shown})")
        if self.loaded:
            parts.append(f"executable loaded {self.loaded:.2f} s")
        if self.held:
            parts.append(f"original not compiled (holds at least {format_bytes(self.held)})")
        n = len(self.compiles)
        parts.append(f"{n} compile{'s' if n != 1 else ''} {compiled:.2f} s")
        how = _ORIGINS.get(self.origin, self.origin)
        return f"{how} in {self.total:.2f} s: " + "; ".join(parts)


_ORIGINS = {
    "re-sized": "re-sized (the plan at other shapes' chunk scale, the original not compiled)",
    "reused": "reused (verified before in this process)",
    "loaded": "loaded from the plan store and verified",
}


class _Before:
    """:attr:`Plan.before`: the original program's footprint; where the search did not compile
    the original (it was known not to fit), measured on first read by ``measure_before`` (a
    compile then, not while planning), and None where that fails."""

    def __get__(self, plan: Plan | None, owner: type | None = None) -> Footprint | None:
        if plan is None:
            return None  # the field's default
        value = plan.__dict__.get("_before")
        measure = plan.__dict__.get("measure_before")
        if value is None and measure is not None:
            plan.__dict__["measure_before"] = None
            value = plan.__dict__["_before"] = measure()
        return value

    def __set__(self, plan: Plan, value: Footprint | None) -> None:
        plan.__dict__["_before"] = value


@dataclass
class Plan:
    """The driver's account of one program (one set of argument shapes).

    ``time`` (not compared, not printed) is how long planning took, by phase.
    ``measure_before`` (not compared, not printed, not stored): where the original program was
    not compiled while planning, what measures :attr:`before` on first read.
    """

    memory_limit: int
    before: Footprint | None = _Before()  # type: ignore[assignment]
    after: Footprint | None = None
    fits_unchanged: bool = False
    records: list[Record] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    backward: Plan | None = None
    tuning: str = ""  # how the first calls chose between compile options (memsafe.tuning)
    time: PlanTime = field(default_factory=PlanTime, compare=False, repr=False)
    # the chunk scale and roll setting of the attempt that runs (a search at new shapes starts
    # there, memsafe.search.Hint)
    chunk_scale: float | None = field(default=None, compare=False, repr=False)
    rolled: bool = field(default=True, compare=False, repr=False)
    measure_before: Callable[[], Footprint | None] | None = field(
        default=None, compare=False, repr=False
    )

    def __copy__(self) -> Plan:
        """A shallow copy that keeps ``measure_before`` (pickling drops it)."""
        new = Plan.__new__(Plan)
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self) -> dict[str, Any]:
        """What pickling stores: the fields, without ``measure_before`` (a compile of this
        process's function; a stored plan's ``before`` is the one measured, or None)."""
        state = dict(self.__dict__)
        state["measure_before"] = None
        return state

    @property
    def rules(self) -> list[RuleRecord]:
        return [r for r in self.records if isinstance(r, RuleRecord)]

    @property
    def splits(self) -> list[SplitRecord]:
        return [r for r in self.records if isinstance(r, SplitRecord)]

    @property
    def recompute_flops(self) -> int:
        """Estimated flops the staged splits and rematerialized loops of this plan and its
        backward plan recompute."""
        own = sum(s.recompute_flops for s in self.splits)
        own += sum(int(r.data.get("recompute_flops", 0)) for r in self.passes)
        return own + (self.backward.recompute_flops if self.backward is not None else 0)

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
        if self.recompute_flops:
            flops = self.recompute_flops
            lines.append(f"  recompute cost: ~{flops:.2g} flops (staged splits, halos, remat)")
        if self.after is not None and not self.fits_unchanged:
            lines.append(f"  after:  {self.after.describe()}")
        if len(self.attempts) > 1:
            lines.append(f"  verified after {len(self.attempts)} compile attempts")
        if self.tuning:
            lines.append(f"  tuned: {self.tuning}")
        lines.append(f"  {DIFFERENTIATION}")
        return shorten_paths("\n".join(lines))

    def summary(self) -> str:
        """One line: the limit, the footprint before and after, and what was done."""
        before = format_bytes(self.before.total) if self.before is not None else "?"
        if self.fits_unchanged:
            return f"limit {format_bytes(self.memory_limit)}: fits unchanged ({before})"
        after = format_bytes(self.after.total) if self.after is not None else "?"
        counts = (
            (self.rules, "rule", "rules"),
            (self.splits, "split", "splits"),
            (self.passes, "other pass", "other passes"),
        )
        done = ", ".join(f"{len(r)} {one if len(r) == 1 else many}" for r, one, many in counts)
        return f"limit {format_bytes(self.memory_limit)}: {before} -> {after}; {done}"

    def __repr__(self) -> str:
        return f"<memsafe Plan {self.summary()}; print() it for the details>"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython
        p.text(str(self))

    def _repr_html_(self) -> str:
        """An HTML fragment with scoped styles (what Jupyter shows)."""
        return fragment(plan_html(self))


_FOOTPRINT_ROWS = ("arguments", "outputs", "temps", "aliases", "constants", "total")


def plan_html(plan: Plan, title: str = "memsafe plan") -> str:
    """The plan's HTML body: footprints before and after, what was done, the compile attempts."""
    shown = [(n, f) for n, f in (("before", plan.before), ("after", plan.after)) if f is not None]
    rows = [[k, *(format_bytes(getattr(f, k)) for _, f in shown)] for k in _FOOTPRINT_ROWS]
    parts = [
        f"<h3>{html.escape(title)} (limit {html.escape(format_bytes(plan.memory_limit))})</h3>",
        "<p>fits unchanged: the original program runs as is</p>" if plan.fits_unchanged else "",
        table(["", *(n for n, _ in shown)], rows, range(1, len(shown) + 1)),
    ]
    if plan.records:
        records = [
            [type(r).__name__[:-6].lower(), shorten_paths(r.describe())] for r in plan.records
        ]
        parts.append(table(["what", "detail"], records))
    if plan.attempts:
        attempts = [
            [
                f"{a.chunk_scale:g}",
                format_bytes(a.footprint.total) if a.footprint else "-",
                "yes" if a.fits else "no",
                a.note,
            ]
            for a in plan.attempts
        ]
        parts.append(table(["chunk scale", "footprint", "fits", "note"], attempts, {0, 1}))
    if plan.backward is not None:
        parts.append(plan_html(plan.backward, "backward (gradient) plan"))
    return "".join(parts)
