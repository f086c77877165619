"""The attempt search: the original program when it fits, else the passes run at shrinking
chunk scales until a compile of the rewrite fits the limit (larger chunks tried again where
the fitting one left much of the room unused)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from memsafe import _jax, log, passes, policy
from memsafe.compiling import (
    Compiled,
    CompileWith,
    Compiling,
    What,
    compile_measured,
    emit,
    tuned,
    with_trial,
)
from memsafe.context import PassContext
from memsafe.errors import MemoryLimitError
from memsafe.graph import Graph, estimate, inline_calls
from memsafe.graph.held import held_bytes
from memsafe.limits import format_bytes
from memsafe.pipeline import run_passes
from memsafe.plan import Attempt, Plan, PlanTime
from memsafe.program import Program
from memsafe.split.strategies.sharded import mesh
from memsafe.xla import (
    Footprint,
    contractions_stored,
    hidden_constant_bytes,
    loop_options,
    measuring_options,
)


@dataclass(frozen=True)
class SearchPolicy:
    """The knobs of the attempt search.

    Attributes:
        max_attempts: compile-and-verify rounds tried, shrinking chunk sizes each time.
        first_shrink: the first retry shrinks the chunk scale by the excess with a margin, at
            least by this factor; later ones at least halve it, so that the rounds reach small
            chunks.
        shrink_margin: the margin of every shrink (and of every growth).
        grow_below: an attempt that fits with its splits at the smallest chunk (the size model,
            conservative, expected no chunk to fit) is tried again at a larger chunk scale where
            its temporaries used under this share of the room, by the room left (at most
            ``grow_max`` times): the model's margin costs speed, not memory (a fori_loop MLP's
            gradient ran 4096 chunks of 1 row in 1.8 MiB of 5 MiB room, 12x slower than
            jax.jit).
        grow_max: see ``grow_below``.
        refill_below: an attempt that fits after one over the limit, with its temporaries under
            this share of the room, is tried once more at the scale interpolated between the two
            (retries at least halve the scale: the Sinkhorn gradient at 4096^2 under 32 MiB went
            from 32.1 MiB, 0.1 MiB over, to 16.5 MiB, and replayed its backward loop 50 times
            where 27 fit).
        speculate_above: the original program is compiled beside the first attempt when its
            estimated peak exceeds the limit by this factor (below, it may well fit, and the
            attempt would be wasted work).
    """

    max_attempts: int = 6
    first_shrink: float = 0.8
    shrink_margin: float = 0.9
    grow_below: float = 0.5
    grow_max: float = 8.0
    refill_below: float = 0.75
    speculate_above: float = 1.5


#: The policy every search uses.
SEARCH = SearchPolicy()


@dataclass(frozen=True)
class Hint:
    """What the plan of the same program at other argument shapes found, for a search at new
    shapes (another batch size or sequence length) to start from.

    Attributes:
        avals: the shapes it was planned at.
        scale: the chunk scale of the attempt that ran.
        roll: whether the roll pass was on for it.
        budget: the bytes that attempt's passes sized chunks from (``scale`` times the room
            for temporaries at those shapes); 0: not known.
        used: the bytes its temporaries took, as XLA measured them.
    """

    avals: tuple[jax.ShapeDtypeStruct, ...]
    scale: float
    roll: bool
    budget: int = 0
    used: int = 0

    @classmethod
    def of(cls, program: Program) -> Hint | None:
        """The hint a verified program gives (None where it fits unchanged)."""
        plan = program.plan
        if plan.fits_unchanged or plan.chunk_scale is None:
            return None
        budget = used = 0
        if plan.after is not None:
            used = plan.after.temps + plan.after.generated_code
            room = max(0, plan.memory_limit - (plan.after.total - used))
            budget = int(plan.chunk_scale * room)
        return cls(program.avals, plan.chunk_scale, plan.rolled, budget, used)

    def scale_at(self, room: int) -> float:
        """The chunk scale to start from at new shapes with ``room`` bytes for temporaries:
        the one that gives the passes the budget in bytes the hint's chunks were sized from,
        shrunk by the search's margin where the temporaries measured would not fit ``room``.

        A budget in bytes, not a share of the room: the size model sizes a chunk from bytes, and
        along an axis that grew (the batch) it then chooses the chunks that ran, whose
        temporaries were measured, while the room shrank by the larger arguments and the bytes
        the loops hold (accumulators of parameter gradients) stayed as they were (an MLP
        training step at twice the batch: at the hint's scale its 100 MiB limit left the
        model no chunk that fit, and its chunks were floored)."""
        if self.budget <= 0 or room <= 0:
            return self.scale
        fits = min(1.0, SEARCH.shrink_margin * room / max(self.used, 1))
        return self.budget * fits / room

    def covers(self, avals: Sequence[jax.ShapeDtypeStruct]) -> bool:
        """Whether ``avals`` are as large as this hint's in every dimension (and as many, of the
        same dtypes): then the original program, which did not fit at the smaller shapes, is
        taken not to fit either, and is not compiled."""
        return len(avals) == len(self.avals) and all(
            a.dtype == b.dtype
            and len(a.shape) == len(b.shape)
            and all(x >= y for x, y in zip(a.shape, b.shape))
            for a, b in zip(avals, self.avals)
        )


def search(
    flat_fun: Callable[..., Any],
    closed: _jax.ClosedJaxpr,
    start: _jax.ClosedJaxpr | None,
    avals: Sequence[jax.ShapeDtypeStruct],
    memory_limit: int,
    donate: tuple[int, ...],
    name: str,
    compiler_options: Mapping[str, Any] | None,
    out_tree: Any,
    on_mesh: mesh.MeshPlan | None = None,
    hint: Hint | None = None,
) -> Program:
    """The original program when it fits, else the rewrite of ``start`` (default ``closed``)
    with the largest chunks that compile under the limit (per device, sharded, on a mesh).

    Where the original is estimated well over the limit, it compiles in a worker thread while
    the first attempt is planned and compiled, from the fixed bytes its arguments and outputs
    are expected to take; the attempt is used only if the original does not fit and its fixed
    bytes are the ones expected, so the outcome is the one of compiling first and planning
    after.

    Args:
        flat_fun: the flat function traced to ``closed``.
        closed: the program as traced.
        start: an equivalent program to rewrite instead (None: ``closed``).
        avals: the flat arguments' shapes and dtypes (placed, on a mesh).
        memory_limit: bytes (per device, on a mesh).
        donate: donated argument positions.
        name: the function's name, in logs and errors.
        compiler_options: the user's compiler options.
        out_tree: the outputs' tree structure.
        on_mesh: the mesh the program runs on, if any.
        hint: the plan of the same program at smaller shapes (:class:`Hint`): where it
            :meth:`~Hint.covers` ``avals``, the original is not compiled and the attempts start
            at its chunk scale (the program is "re-sized"); where no attempt fits from there,
            the search runs in full.

    Returns:
        The verified :class:`Program`.

    Raises:
        MemoryLimitError: no attempt fits the limit.
    """
    hidden = hidden_constant_bytes(closed.consts)
    time = PlanTime()
    attempts = Search(
        start or closed,
        avals,
        memory_limit,
        donate,
        name,
        compiler_options,
        hidden,
        out_tree,
        time,
        on_mesh,
    )
    if hint is not None and on_mesh is None and not donate and hint.covers(avals):
        resized = _resized(attempts, closed, memory_limit, hint, time)
        if resized is not None:
            return resized
        attempts.roll = True
    if start is None and on_mesh is None and not donate:
        skipped = _without_original(
            attempts, flat_fun, closed, memory_limit, compiler_options, time
        )
        if skipped is not None:
            return skipped
    peak = estimate(Graph(closed)).peak_bytes
    guess = None if on_mesh is not None else speculative_fixed(closed, donate, memory_limit, peak)
    what = (name, "original program", memory_limit)
    # expected over the limit: compiled to be measured, without allocating (GPU autotuning)
    options = measuring_options(compiler_options) if peak > memory_limit else compiler_options
    compiling = Compiling(
        flat_fun, avals, options, donate, hidden, what, background=guess is not None
    )
    first = None if guess is None else attempts.attempt_or_none(guess)
    original = compiling.result()
    plan = Plan(memory_limit=memory_limit, before=original.footprint, time=time)
    time.compiles.append(("original program", original.seconds))
    if original.footprint.total <= memory_limit:
        return _unchanged(attempts, flat_fun, closed, original, options, plan)
    if on_mesh is None:
        fixed = check_fixed(original.footprint, memory_limit, name)
    else:
        fixed = on_mesh.check_fixed(original.footprint, avals, memory_limit, name)
    return attempts.run(plan, fixed, first if guess == fixed else None)


def _without_original(
    attempts: Search,
    flat_fun: Callable[..., Any],
    closed: _jax.ClosedJaxpr,
    memory_limit: int,
    compiler_options: Mapping[str, Any] | None,
    time: PlanTime,
) -> Program | None:
    """The rewrite, planned without compiling the original program, where the bytes every
    compile of the original holds (:func:`memsafe.graph.held.held_bytes`: arguments, outputs and
    the contraction results live together) are already over the limit, and its arguments and
    outputs fit it; else None (the original is compiled first). The attempts are verified as
    always; the plan's ``before`` is measured when first read (``Plan.measure_before``)."""
    fixed = _fixed_bytes(closed)
    if fixed > memory_limit or not contractions_stored(compiler_options):
        return None
    held = held_bytes(attempts.flat)
    if held <= memory_limit:
        return None
    log.note(
        logging.INFO,
        "%s: the original program holds at least %s at once (arguments, outputs, contraction "
        "results), over the limit of %s: planned without compiling it",
        attempts.name,
        format_bytes(held),
        format_bytes(memory_limit),
    )
    time.held = held
    plan = Plan(memory_limit=memory_limit, time=time)
    plan.measure_before = _measurer(attempts, flat_fun, compiler_options)
    return attempts.run(plan, fixed, None)


def _measurer(
    search: Search, flat_fun: Callable[..., Any], compiler_options: Mapping[str, Any] | None
) -> Callable[[], Footprint | None]:
    """What measures the original program's footprint when a plan's ``before`` is first read
    (once, for every copy of the plan); None where it does not compile."""
    what = (search.name, "original program (the plan's before)", search.memory_limit)
    avals, donate, hidden = search.avals, search.donate, search.hidden

    @functools.cache
    def measure() -> Footprint | None:
        try:
            options = measuring_options(compiler_options)
            return compile_measured(flat_fun, avals, options, donate, hidden, what).footprint
        except Exception as err:  # only a report's number is missing
            log.note(logging.INFO, "%s: the original did not compile (%s)", search.name, err)
            return None

    return measure


def _unchanged(
    search: Search,
    flat_fun: Callable[..., Any],
    closed: _jax.ClosedJaxpr,
    original: Compiled,
    options: Mapping[str, Any] | None,
    plan: Plan,
) -> Program:
    """The original program, which fits: compiled to run where it was compiled (with
    ``options``) only to be measured, recorded in ``plan``, with a trial of other compile
    options where worth it."""
    user, memory_limit, name = search.options, search.memory_limit, search.name

    def compiler(suffix: str) -> CompileWith:
        """A compile of the original program with other options (logged with ``suffix``)."""
        again = (name, f"original program, {suffix}", memory_limit)
        avals, donate, hidden = search.avals, search.donate, search.hidden
        return lambda o: compile_measured(flat_fun, avals, o, donate, hidden, again)

    if options is not user:  # compiled to measure: now compiled to run
        measured = original
        original = tuned(original, user, memory_limit, compiler("tuned"))
        if original is not measured:
            search.time.compiles.append(("original program, tuned", original.seconds))
    plan.fits_unchanged = True
    plan.after = original.footprint
    plan.attempts.append(Attempt(1.0, original.footprint, True, "original program"))
    program = Program(
        original.jitted,
        flat_fun,
        tuple(search.avals),
        search.out_tree,
        plan,
        closed,
        original.compiled,
        on_mesh=search.on_mesh,
        options=user,
    )
    return with_trial(program, compiler("candidate options"), user, user, name)


def _resized(
    attempts: Search, closed: _jax.ClosedJaxpr, memory_limit: int, hint: Hint, time: PlanTime
) -> Program | None:
    """The rewrite at new shapes, its attempts started at ``hint``'s chunk scale, without
    compiling the original (see :func:`search`); None where none fits from there."""
    fixed = _fixed_bytes(closed)
    if fixed > memory_limit:
        return None
    time.origin = "re-sized"
    plan = Plan(memory_limit=memory_limit, time=time)
    attempts.roll = hint.roll
    scale = hint.scale_at(memory_limit - fixed - attempts.hidden)
    try:
        return attempts.attempts(plan, fixed, None, scale)
    except MemoryLimitError:
        time.origin = "planned"
        return None


def check_fixed(before: Footprint, memory_limit: int, name: str) -> int:
    """Bytes no rewrite can shrink (arguments and outputs); raises when they exceed the limit."""
    fixed = before.arguments + before.outputs - before.aliases
    if fixed > memory_limit:
        raise MemoryLimitError(
            f"{name}: its arguments and outputs alone need {format_bytes(fixed)} "
            f"(arguments {format_bytes(before.arguments)}, outputs {format_bytes(before.outputs)}),"
            f" more than the limit; no rewrite can shrink them",
            limit=memory_limit,
            footprint=before.total,
        )
    return fixed


def next_scale(
    scale: float, attempt: int, after: Footprint, memory_limit: int, fixed: int
) -> float:
    """The chunk scale of the next attempt: shrunk in proportion to the excess (chunk temps
    scale about linearly), with a margin; halving outright cost the 10k x 1M kNN 2x its loop
    count after a 4% overshoot."""
    excess = after.total - memory_limit
    room = max(1, memory_limit - fixed)
    at_most = SEARCH.first_shrink if attempt == 0 else 0.5
    return scale * min(at_most, SEARCH.shrink_margin * room / (room + excess))


def refusal(
    flat: Any,
    name: str,
    memory_limit: int,
    before: Footprint | None,
    best: Footprint | None,
    blockers: list,
) -> MemoryLimitError:
    """The error when no attempt fit: the largest intermediates and what stopped each split."""
    largest = Graph(flat).largest(5)
    detail = ", ".join(f"{v.dtype}{list(v.shape)} ({format_bytes(v.bytes)})" for v in largest[:3])
    under = 0 if best is None else (best.total - memory_limit) // policy.REFUSAL.gap_share
    kept = [b for b in blockers if b.bytes >= under]
    return MemoryLimitError(
        f"{name}: no rewrite brought the footprint under the limit "
        f"(largest intermediates: {detail})",
        limit=memory_limit,
        footprint=None if best is None else best.total,
        blockers=kept,
        minimum=min((f.total for f in (before, best) if f is not None), default=None),
        omitted=(len(blockers) - len(kept), under),
    )


def speculative_fixed(
    closed: _jax.ClosedJaxpr, donate: tuple[int, ...], memory_limit: int, peak: int
) -> int | None:
    """The arguments' and outputs' bytes as XLA counts them on this backend (a tuple of
    outputs adds a pointer each), when the original's estimated ``peak`` is over
    ``SEARCH.speculate_above`` times the limit, nothing is donated and those bytes fit the
    limit; else None (no speculation: where they exceed it, the original's compile ends in a
    refusal, and an attempt planned without room can be a program XLA is slow to compile: on an
    H100, the one-GPU kNN check's first attempt under 96 MiB, with its 256 MiB database,
    compiled for over 190 s where the original compiled in 0.2 s)."""
    if donate or peak <= SEARCH.speculate_above * memory_limit:
        return None
    fixed = _fixed_bytes(closed)
    return fixed if fixed <= memory_limit else None


def _fixed_bytes(closed: _jax.ClosedJaxpr) -> int:
    """The arguments' and outputs' bytes as XLA counts them on this backend (a tuple of outputs
    adds a pointer each), nothing donated."""
    arguments = sum(_jax.nbytes_of_aval(v.aval) for v in closed.jaxpr.invars)
    outs = closed.jaxpr.outvars
    table = 8 * len(outs) if len(outs) > 1 else 0
    return arguments + sum(_jax.nbytes_of_aval(v.aval) for v in outs) + table


class _Uncompiled(Exception):
    """An attempt's program that XLA failed to compile (an internal error of the compiler, not
    of the program: the search plans the next attempt instead of ending the user's call)."""

    def __init__(self, what: str, err: Exception) -> None:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        super().__init__(f"XLA failed to compile {what}: {first[:300]}")


def _compiler_failure(err: Exception) -> bool:
    """Whether a compile's error is the compiler's own failure (an internal error, an
    unimplemented case), not one a program would raise again however it is planned."""
    return str(err).lstrip().startswith(("INTERNAL", "UNIMPLEMENTED"))


@dataclass(frozen=True)
class Tried:
    """One attempt: the rewritten program, its compile, its plan and what blocked splits."""

    program: _jax.ClosedJaxpr
    emitted: Callable[..., Any]
    got: Compiled
    plan: Plan
    blockers: list
    scale: float
    placed: tuple  # the argument avals compiled for (placed on a mesh)
    what: What
    options: Mapping[str, Any] | None  # the compiler options it runs with (see loop_options)
    held_declined: bool = False  # a floored split of held values found, not taken


@dataclass(frozen=True)
class _Start:
    """What the leading scale-free passes made of the program (shared by the attempts)."""

    names: tuple[str, ...]
    program: _jax.ClosedJaxpr
    records: tuple
    blockers: tuple


class Search:
    """The passes run at shrinking chunk scales until a compile fits the limit.

    Args: as :func:`search`'s (``start`` the program rewritten), ``hidden``: bytes of
    constants XLA's memory analysis does not count, and ``time``: where the passes' and the
    compiles' seconds are added.
    """

    def __init__(
        self,
        start: _jax.ClosedJaxpr,
        avals: Sequence[jax.ShapeDtypeStruct],
        memory_limit: int,
        donate: tuple[int, ...],
        name: str,
        compiler_options: Mapping[str, Any] | None,
        hidden: int,
        out_tree: Any,
        time: PlanTime,
        on_mesh: mesh.MeshPlan | None = None,
    ) -> None:
        self.flat = inline_calls(start)
        self.avals, self.memory_limit, self.donate, self.name = avals, memory_limit, donate, name
        self.options, self.hidden, self.out_tree = compiler_options, hidden, out_tree
        self.on_mesh, self.time = on_mesh, time
        self.roll, self.rolled = True, False  # see run
        self.held, self.took_held = True, False  # see run
        self._start: _Start | None = None  # see _scale_free
        self._later: dict[tuple[str, int], tuple] = {}  # see _rest

    def attempt(
        self,
        index: int,
        scale: float,
        fixed: int,
        previous: list | None = None,
        floored_held: bool = False,
    ) -> Tried | None:
        """The passes at chunk ``scale`` given ``fixed`` bytes, then the compile; None, with
        nothing compiled, when the passes did what they did in the ``previous`` attempt (its
        records: the same program). ``floored_held``: see ``PassContext.floored_held``."""
        attempt_plan = Plan(memory_limit=self.memory_limit)
        ctx = PassContext(
            self.memory_limit,
            fixed + self.hidden,
            attempt_plan,
            chunk_scale=scale,
            roll=self.roll,
            floored_held=floored_held,
            held=self.held,
        )
        sharding = None if self.on_mesh is None else self.on_mesh.sharding()
        ctx.mesh = sharding  # records where the sharded loops want the inputs placed
        named = passes.named_passes()
        lead = passes.scale_free_lead()
        start = self._scale_free(named[:lead], fixed)
        for record in start.records:
            ctx.record(record)
        for blocker in start.blockers:
            ctx.block(blocker)
        program = self._rest(named[lead:], start.program, ctx)
        retried = {name for name, _ in passes.named_passes(passes.RETRIED_WITHOUT)}
        self.rolled |= any(getattr(r, "pass_name", "") in retried for r in attempt_plan.records)
        self.took_held |= ctx.held_taken
        if previous is not None and attempt_plan.records == previous:
            return None
        emitted = emit(program, self.flat.out_avals)
        what = (self.name, f"attempt {index + 1} (chunk scale {scale:.3g})", self.memory_limit)
        hidden_now = hidden_constant_bytes(program.consts)
        placed = tuple(self.avals if sharding is None else sharding.placed(self.avals))
        options = loop_options(self.options, _jax.dtypes_in(program.jaxpr))
        # over the limit or not, this compile allocates nothing of the program's size
        measure = measuring_options(options)
        try:
            got = compile_measured(emitted, placed, measure, self.donate, hidden_now, what)
        except jax.errors.JaxRuntimeError as err:
            if not _compiler_failure(err):
                raise
            raise _Uncompiled(what[1], err) from err
        self.time.compiles.append((what[1], got.seconds))
        return Tried(
            program,
            emitted,
            got,
            attempt_plan,
            ctx.blockers,
            scale,
            placed,
            what,
            options,
            ctx.held_declined,
        )

    def _scale_free(self, named: tuple, fixed: int) -> _Start:
        """The program after the leading passes that do not depend on the attempt
        (:func:`memsafe.passes.scale_free_lead`), run once per search (for these passes)."""
        names = tuple(name for name, _ in named)
        if self._start is None or self._start.names != names:
            ctx = PassContext(self.memory_limit, fixed + self.hidden, Plan(self.memory_limit))
            program = run_passes(named, self.flat, ctx, self.name, self.time.passes)
            self._start = _Start(names, program, tuple(ctx.plan.records), tuple(ctx.blockers))
        return self._start

    def _rest(self, named: tuple, program: _jax.ClosedJaxpr, ctx: PassContext) -> Any:
        """The passes after the scale-free lead, in order; a later pass that declares
        ``SCALE_FREE`` is run once per program it is given in this search: an attempt that
        gives it a program an earlier attempt gave it (the same object: the passes before it
        chose as they did) takes its program, records and blockers again."""
        free = passes.scale_free_names()
        for pass_name, run in named:
            if pass_name not in free:
                program = run_passes(((pass_name, run),), program, ctx, self.name, self.time.passes)
                continue
            key = (pass_name, id(program))
            kept = self._later.get(key)
            if kept is None or kept[0] is not program:
                alone = dataclasses.replace(ctx, plan=Plan(self.memory_limit), blockers=[])
                out = run_passes(((pass_name, run),), program, alone, self.name, self.time.passes)
                kept = (program, out, tuple(alone.plan.records), tuple(alone.blockers))
                self._later[key] = kept
            for record in kept[2]:
                ctx.record(record)
            for blocker in kept[3]:
                ctx.block(blocker)
            program = kept[1]
        return program

    def attempt_or_none(self, fixed: int) -> Tried | None:
        """The first attempt, or None where it fails (raised again, if the original does not
        fit, when the attempt is made in turn)."""
        try:
            return self.attempt(0, 1.0, fixed)
        except Exception:  # the original may fit: then the rewrite's failure does not matter
            return None

    def _compiler(self, tried: Tried, suffix: str) -> CompileWith:
        """A compile of ``tried``'s program with other options (logged with ``suffix``)."""
        hidden = hidden_constant_bytes(tried.program.consts)
        name, description, memory_limit = tried.what
        what = (name, f"{description}, {suffix}", memory_limit)

        def compile_with(options: Mapping[str, Any] | None) -> Compiled:
            return compile_measured(tried.emitted, tried.placed, options, self.donate, hidden, what)

        return compile_with

    def _program(self, tried: Tried, plan: Plan) -> Program:
        """The program of ``tried`` (which fits), compiled to run, with a trial of other compile
        options where worth it; recorded in ``plan``."""
        got = tuned(tried.got, tried.options, self.memory_limit, self._compiler(tried, "tuned"))
        if got is not tried.got:
            self.time.compiles.append((f"{tried.what[1]}, tuned", got.seconds))
        plan.records, plan.after = tried.plan.records, got.footprint
        plan.chunk_scale, plan.rolled = tried.scale, self.roll
        program = Program(
            got.jitted,
            tried.emitted,
            tried.placed,
            self.out_tree,
            plan,
            tried.program,
            got.compiled,
            on_mesh=self.on_mesh,
            options=tried.options,
        )
        compile_with = self._compiler(tried, "candidate options")
        return with_trial(program, compile_with, tried.options, self.options, self.name)

    def _grown(
        self,
        index: int,
        scale: float,
        fixed: int,
        tried: Tried,
        plan: Plan,
        over: tuple[float, int] | None = None,
        floored_held: bool = False,
    ) -> Tried:
        """``tried`` (which fits), or an attempt at a larger chunk scale that fits too, where
        ``tried`` split at the smallest chunks with most of the room unused (``grow_below``),
        or followed an attempt over the limit (``over``: its scale and temporaries) and left
        much of the room unused (``refill_below``); the larger attempt is kept only where its
        splits run fewer loop iterations (at a larger scale the passes may choose other splits:
        a tiled top_k's 7 iterations became 10 of a query split).

        The first larger scale assumes the temporaries grow with the scale, or interpolates
        between ``tried`` and ``over``; where that attempt is over the limit, a second one
        interpolates between the two footprints measured. ``floored_held``: as ``tried``'s."""
        room = self.memory_limit - fixed
        margin = SEARCH.shrink_margin
        low = (scale, tried.got.footprint.total - fixed)
        if any(s.floored for s in tried.plan.splits) and low[1] < SEARCH.grow_below * room:
            up = scale * min(SEARCH.grow_max, margin * room / max(low[1], 1))
            floored = _floored_up(tried, int(margin * room) - low[1])
            if floored is not None:  # no further than the floored splits' chunks allow
                up = min(up, floored)
            if over is not None:  # no further than the scale measured over the limit says
                up = min(up, _between(low, over, margin * room))
            note, tries = "grown: the smallest chunks fit", 2
        elif over is not None and low[1] < SEARCH.refill_below * room:
            up = _between(low, over, margin * room)
            note, tries = "grown: between the last two attempts", 1
        else:
            return tried
        for step in range(tries):
            if index + 1 + step >= SEARCH.max_attempts:
                break
            try:
                bigger = self.attempt(
                    index + 1 + step, up, fixed, tried.plan.records, floored_held=floored_held
                )
            except _Uncompiled as err:  # keep the attempt that fits
                log.note(logging.WARNING, "%s: %s", self.name, err)
                break
            if bigger is None:  # the passes did the same at the larger scale
                break
            after = bigger.got.footprint
            fits = after.total <= self.memory_limit
            plan.attempts.append(Attempt(up, after, fits, note))
            if fits:  # kept where its loops run fewer iterations (it may split otherwise)
                return bigger if _iterations(bigger) < _iterations(tried) else tried
            up = _between(low, (up, after.total - fixed), margin * room)
        return tried

    def run(self, plan: Plan, fixed: int, first: Tried | None) -> Program:
        """The first attempt that fits (see :meth:`attempts`). Where none does, the program is
        planned again with fewer means, each that the attempts used switched off in turn:

        - where the roll pass rolled repeated blocks into scans, without rolling (a scan can
          stop a split the unrolled blocks allow: a ResNet's batch-norm stages);
        - where the split pass took a split measured against the room (``PassContext.held``),
          without such splits: one taken at every scale can keep out a split that fits (fuzz
          seed 716's gradient: a stacked mask's split in two, taken by that retry at the
          smaller scales, held the program at 124 KiB against 94 KiB; without it, 62 KiB).

        Raises the MemoryLimitError of the plan that came closest."""
        errors: list[MemoryLimitError] = []
        try:
            return self.attempts(plan, fixed, first)
        except MemoryLimitError as err:
            errors.append(err)
        for used, switch in ((lambda: self.rolled, "roll"), (lambda: self.took_held, "held")):
            if not used():
                continue
            setattr(self, switch, False)
            try:
                return self.attempts(plan, fixed, None)
            except MemoryLimitError as err:
                errors.append(err)
        raise min(errors, key=_closeness) from None

    def attempts(self, plan: Plan, fixed: int, first: Tried | None, scale: float = 1.0) -> Program:
        """The first attempt that fits (``first``, made already, or planned now from chunk
        ``scale``), recorded in ``plan``; raises MemoryLimitError when none does, with the
        footprint and blockers of the attempt that came closest.

        Floored splits of held values (``PassContext.floored_held``) are allowed once an attempt
        at a shrunk chunk scale was over the limit: a GPT training step over at scale 1 fits at
        0.2 without them (with them, 1,024 loops of one row: 6x slower), fuzz seeds 37 and 78
        need them. Where that attempt found such a split and did not take it, the next attempt
        is made at the same scale with them: the floored chunk is sized from the scale
        (``memsafe.split.program._floor``), and the scale shrunk after an attempt that the
        missing split left unsplit is far smaller (a graph round under 872.9 KiB, unsplit at
        4.1 MiB at scale 0.66, took its edges one at a time at the next scale, 0.089, and was
        refused at 950.7 KiB; at 0.66 with them it fits at 734.8 KiB)."""
        last, closest, previous, over = None, None, None, None
        floored, note = False, ""
        failed: list[_Uncompiled] = []
        for index in range(SEARCH.max_attempts):
            if index == 0 and first is not None:
                last = first
            else:
                try:
                    last = self.attempt(index, scale, fixed, previous, floored_held=floored)
                except _Uncompiled as err:  # planned again at smaller chunks: another program
                    failed.append(err)
                    log.note(logging.WARNING, "%s: %s", self.name, err)
                    last = None
            if last is None:  # the same program as the last compile: shrink further
                scale *= 0.5
                continue
            after = last.got.footprint
            fits = after.total <= self.memory_limit
            plan.attempts.append(Attempt(scale, after, fits, note))
            note = ""
            if closest is None or after.total < closest.got.footprint.total:
                closest = last
            if fits:
                grown = self._grown(index, scale, fixed, last, plan, over, floored)
                return self._program(grown, plan)
            # even where nothing was split, a smaller budget may make the passes act: their
            # size model can count less than XLA keeps (the 4-block GPT gradient at L=2048:
            # 431 MiB modelled, 803 MiB compiled, nothing split under 497 MiB of budget)
            previous, over = last.plan.records, (scale, after.total - fixed)
            if not floored and scale < 1.0:
                floored = True
                if last.held_declined:  # the same scale again, with the split it declined
                    note = "again with the floored split of held values it declined"
                    continue
            scale = next_scale(scale, index, after, self.memory_limit, fixed)
        if closest is None and failed:
            raise MemoryLimitError(
                f"{self.name}: XLA could not compile any program memsafe planned for this limit "
                f"({len(failed)} attempts; the first: {failed[0]})",
                limit=self.memory_limit,
            )
        best = None if closest is None else closest.got.footprint
        blockers = [] if closest is None else closest.blockers
        raise refusal(self.flat, self.name, self.memory_limit, plan.before, best, blockers)


def _floored_up(tried: Tried, target: int) -> float | None:
    """The chunk scale at which the size model sizes the floored splits of ``tried`` (which
    fits) at chunks whose values take about ``target`` bytes (the smallest such scale over
    them), from the model's numbers in their records; None where none carries them.

    A floored chunk is sized from a share of the budget (``memsafe.split.program._floor``), not
    from the budget the model would need, so its temporaries do not grow with the chunk scale:
    XLA also places a small chunk's values in the outputs' buffers before those are written (an
    MLP training step's 32-row chunks measured 280 bytes of temporaries, its 5,462-row ones
    145 MiB, where growth in proportion to the scale took 8 times the scale). A position of
    the axis is taken to cost all the too-large values the split's region computes
    (``bytes / size``), or the model's bytes per position where more; at the scale returned,
    the model's held bytes and that many positions fill the split's budget."""
    needs = []
    for split in tried.plan.splits:
        if not split.floored or split.per_unit <= 0 or split.room <= 0:
            continue
        per_position = max(split.per_unit, -(-split.bytes // max(split.size, 1)))
        positions = min(split.share or split.size, max(split.chunk, target // per_position))
        width = positions + 2 * split.extend
        needs.append((split.fixed + split.per_unit * width) / split.room)
    return min(needs, default=None)


def _iterations(tried: Tried) -> int:
    """Loop iterations an attempt's splits run, all together."""
    return sum(r.loops for r in tried.plan.splits)


def _between(low: tuple[float, int], high: tuple[float, int], target: float) -> float:
    """The chunk scale whose temporaries reach ``target``, linear between two attempts'
    (scale, temporaries)."""
    return low[0] + (high[0] - low[0]) * (target - low[1]) / max(high[1] - low[1], 1)


def _closeness(err: MemoryLimitError) -> float:
    """How far a refused plan stayed over its limit: its best footprint (none: the worst)."""
    return float("inf") if err.footprint is None else err.footprint
