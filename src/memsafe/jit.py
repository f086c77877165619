"""``memsafe.jit``: trace, rewrite under a memory limit, verify with XLA, and run.

The driver only orders passes and verifies; the passes do the rewriting (memsafe.passes).
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax

from memsafe import _jax, cache, log, mesh, passes, stages, tuning
from memsafe.arguments import ArgSpec, Call
from memsafe.batching import BatchedProgram, planning
from memsafe.dispatch import MISS, FastPath
from memsafe.errors import ForwardModeError, MemoryLimitError
from memsafe.gradient import differentiable
from memsafe.graph import Graph, estimate, inline_calls
from memsafe.lapack_order import ordered
from memsafe.limits import format_bytes, parse_limit
from memsafe.passes import PassContext
from memsafe.plan import Attempt, PassRecord, Plan
from memsafe.progress import display as progress_display
from memsafe.progress import enabled as progress_enabled
from memsafe.rules.registry import registered_rules
from memsafe.xla import (
    Footprint,
    hidden_constant_bytes,
    loop_options,
    measuring_options,
    memsafe_jit,
    merged_options,
)

#: How many compile-and-verify rounds the driver tries, shrinking chunk sizes each time.
MAX_ATTEMPTS = 6
#: The first retry shrinks the chunk budget by the excess with a margin (at least by
#: FIRST_SHRINK); later ones at least halve it, so that six rounds reach small chunks.
FIRST_SHRINK = 0.8
SHRINK_MARGIN = 0.9
#: An attempt that fits with its splits at the smallest chunk (the size model, conservative,
#: expected no chunk to fit) is tried again at a larger chunk scale where its temporaries used
#: under GROW_BELOW of the room, by the room left (at most GROW_MAX times): the model's
#: margin costs speed, not memory (a fori_loop MLP's gradient ran 4096 chunks of 1 row in
#: 1.8 MiB of 5 MiB room, 12x slower than jax.jit).
GROW_BELOW = 0.5
GROW_MAX = 8.0
#: An attempt that fits after one over the limit, with its temporaries under REFILL_BELOW of the
#: room, is tried once more at the scale interpolated between the two (retries at least halve
#: the scale: the Sinkhorn gradient at 4096^2 under 32 MiB went from 32.1 MiB, 0.1 MiB over, to
#: 16.5 MiB, and replayed its backward loop 50 times where 27 fit).
REFILL_BELOW = 0.75

#: Passes that rewrite expressions into cheaper equivalents whatever the limit. The gradient is
#: taken of the program they produce (custom derivative rules kept), so the backward program
#: benefits from them too: differentiating ``|x|^2 + |y|^2 - 2 x y^T`` needs no n*m*d value.
ALGEBRAIC_PASSES = ("match_replace", "reorder")


@dataclass
class Program:
    """A verified program for one set of argument shapes."""

    jitted: Any  # jax.jit-wrapped function of the flat dynamic arguments
    fun: Callable[..., Any]  # the same, unjitted: what runs inside an outer trace (jit, grad)
    avals: tuple[jax.ShapeDtypeStruct, ...]
    out_tree: Any
    plan: Plan
    closed: _jax.ClosedJaxpr  # the program that runs (original when it fits unchanged)
    compiled: Any = None  # the verified executable, called directly to avoid a second compile
    source: Any = None  # the flat function planned, where it differs from the user's (backward)
    on_mesh: mesh.MeshPlan | None = None  # the mesh it runs on (limit per device), if any
    trial: tuning.Trial | None = None  # compile options being timed over the first calls

    @property
    def settled(self) -> bool:
        """Whether every call runs :attr:`compiled` (no trial of compile options under way)."""
        return self.trial is None or self.trial.settled

    def run(self, flat: Sequence[Any]) -> Any:
        """Run on concrete arrays: the verified executable, or jit's path for odd argument types.
        On a mesh the arguments are first placed as the program was compiled for."""
        if any(getattr(a, "sharding", None) is not None for a in self.avals):
            flat = mesh.place(flat, self.avals)
        if self.compiled is not None:
            try:
                return self.compiled(*flat) if self.settled else self._tried(flat)
            except (TypeError, ValueError):
                pass  # e.g. Python scalars or arrays on another device: let jit convert them
        return self.jitted(*flat)

    def _tried(self, flat: Sequence[Any]) -> Any:
        """A call of the trial, keeping the executable it chose once it has."""
        outs = self.trial.run(flat)
        if self.trial.settled:
            self.compiled = self.trial.chosen
        return outs


def _with_trial(
    program: Program,
    compile_with: Callable[[Mapping[str, Any] | None], _Compiled],
    options: Mapping[str, Any] | None,
    user: Mapping[str, Any] | None,
    name: str,
) -> Program:
    """``program`` with a trial of :data:`memsafe.tuning.CANDIDATE` over its first calls, where
    worth it: compiled by ``compile_with`` with ``options`` (the program's) updated."""
    merged = merged_options(options)
    if program.compiled is None or not tuning.worth_tuning(program.closed, merged, user or {}):
        return program

    def candidate(extra: dict[str, Any]) -> tuple[Any, Footprint] | None:
        try:
            got = compile_with({**dict(options or {}), **extra})
        except Exception:  # an option this jaxlib rejects: the verified executable stays
            return None
        return got.compiled, got.footprint

    program.trial = tuning.Trial(program.compiled, candidate, program.plan, name)
    return program


def _emit(closed: _jax.ClosedJaxpr) -> Callable[..., list[Any]]:
    """A plain JAX function that runs ``closed`` (used to jit and to differentiate)."""

    def run(*flat: Any) -> list[Any]:
        return _jax.eval_jaxpr(closed.jaxpr, closed.consts, *flat)

    return run


def reported(build: Callable[..., Program]) -> Callable[..., Program]:
    """``build_program`` with its outcome logged and, when asked for (``progress``), a progress
    display on stderr while it runs."""

    @functools.wraps(build)
    def run(*args: Any, progress: bool | None = None, **kwargs: Any) -> Program:
        name = kwargs.get("name", args[4] if len(args) > 4 else "function")
        watch = log.Stopwatch()
        with progress_display(name, progress_enabled(progress)):
            try:
                program = build(*args, **kwargs)
            except MemoryLimitError:
                log.note(logging.INFO, "%s: no plan fits (%.2f s)", name, watch.elapsed)
                raise
            log.finished(name, len(program.plan.attempts), True, watch.elapsed)
        return program

    return run


def _trace(flat_fun: Callable[..., Any], avals: Sequence[Any], name: str) -> tuple[Any, Any]:
    """(closed jaxpr, output tree) of ``flat_fun`` at ``avals``; a user's error keeps its type."""
    watch = log.Stopwatch()
    try:
        closed, out_tree = _jax.make_closed_jaxpr(flat_fun, avals)
    except Exception as err:  # the user's own error, kept as it is, with where memsafe was
        shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals)
        err.add_note(f"memsafe: while tracing {name} at arguments ({shapes})")
        raise
    log.traced(name, len(closed.jaxpr.eqns), watch.elapsed)
    return closed, out_tree


@dataclass(frozen=True)
class _Compiled:
    """One program compiled and measured."""

    jitted: Any
    compiled: Any
    footprint: Footprint


class _Compiling:
    """``fun`` lowered (here: tracing runs in the caller's thread, with its JAX settings) and
    compiled with memsafe's options, in a worker thread when ``background``; :meth:`result`
    waits for it and measures the footprint (logged as ``what``: name, description, limit)."""

    def __init__(
        self,
        fun: Callable[..., Any],
        avals: Sequence[Any],
        options: Mapping[str, Any] | None,
        donate: tuple[int, ...],
        hidden: int,
        what: tuple[str, str, int],
        background: bool = False,
    ) -> None:
        self._watch = log.Stopwatch()
        self._jitted = memsafe_jit(ordered(fun), options, donate_argnums=donate)
        lowered = self._jitted.lower(*avals)
        self._hidden, self._what = hidden, what
        self._future: Future | None = None
        if background:
            job = functools.partial(contextvars.copy_context().run, lowered.compile)
            self._future = _compile_pool().submit(job)
        else:
            self._compiled = lowered.compile()

    def result(self) -> _Compiled:
        compiled = self._compiled if self._future is None else self._future.result()
        footprint = Footprint.from_compiled(compiled, self._hidden)
        name, what, limit = self._what
        log.compiled(name, what, footprint.total, limit, self._watch.elapsed)
        return _Compiled(self._jitted, compiled, footprint)


@functools.cache
def _compile_pool() -> ThreadPoolExecutor:
    """The one worker that compiles an original program while its rewrite is planned."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="memsafe-compile")


def _compile(
    fun: Callable[..., Any],
    avals: Sequence[Any],
    options: Mapping[str, Any] | None,
    donate: tuple[int, ...],
    hidden: int,
    what: tuple[str, str, int],
) -> _Compiled:
    """``fun`` compiled with memsafe's options and its footprint (logged as ``what``: name,
    description, limit)."""
    return _Compiling(fun, avals, options, donate, hidden, what).result()


def _tuned(
    measured: _Compiled,
    options: Mapping[str, Any] | None,
    limit: int,
    compile_with: Callable[[Mapping[str, Any] | None], _Compiled],
) -> _Compiled:
    """The program that fits, compiled to run: ``measured`` (compiled with
    :func:`measuring_options`) where those are memsafe's usual ``options`` (the CPU); elsewhere
    ``compile_with(options)`` (a GPU's autotuner on, allocating now only what this program may),
    kept if it also fits ``limit``, else ``measured``."""
    if measuring_options(options) == merged_options(options):
        return measured
    tuned = compile_with(options)
    return tuned if tuned.footprint.total <= limit else measured


def _check_fixed(before: Footprint, memory_limit: int, name: str) -> int:
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


def _next_scale(scale: float, attempt: int, after: Footprint, limit: int, fixed: int) -> float:
    """The chunk scale of the next attempt: shrunk in proportion to the excess (chunk temps
    scale about linearly), with a margin; halving outright cost the 10k x 1M kNN 2x its loop
    count after a 4% overshoot."""
    excess = after.total - limit
    room = max(1, limit - fixed)
    at_most = FIRST_SHRINK if attempt == 0 else 0.5
    return scale * min(at_most, SHRINK_MARGIN * room / (room + excess))


def _refusal(
    flat: Any, name: str, limit: int, before: Footprint, best: Footprint | None, blockers: list
) -> MemoryLimitError:
    """The error when no attempt fit: the largest intermediates and what stopped each split."""
    largest = Graph(flat).largest(5)
    detail = ", ".join(f"{v.dtype}{list(v.shape)} ({format_bytes(v.bytes)})" for v in largest[:3])
    return MemoryLimitError(
        f"{name}: no rewrite brought the footprint under the limit "
        f"(largest intermediates: {detail})",
        limit=limit,
        footprint=None if best is None else best.total,
        blockers=blockers,
        minimum=before.total if best is None else min(best.total, before.total),
    )


@planning
@reported
def build_program(
    flat_fun: Callable[..., Any],
    avals: Sequence[jax.ShapeDtypeStruct],
    memory_limit: int,
    donate: tuple[int, ...] = (),
    name: str = "function",
    compiler_options: Mapping[str, Any] | None = None,
    rewrite_from: Callable[..., Any] | None = None,
    on_mesh: mesh.MeshPlan | None = None,
) -> Program:
    """Trace ``flat_fun`` at ``avals`` and return a program verified to fit ``memory_limit``.

    The original program is returned, unchanged, when it fits. Otherwise the passes rewrite
    ``rewrite_from`` (default ``flat_fun``; an equivalent start, such as the gradient of an
    algebraically rewritten forward), shrinking chunks until a compile fits. ``compiler_options``
    are the user's, merged with memsafe's (see ``xla.merged_options``). With ``on_mesh`` the
    limit is per device, ``avals`` carry the arguments' placement for the original program, and
    the split axes are sharded over the mesh (memsafe.mesh). A program traced the same under the
    same settings before, by any memsafe function, is reused (:mod:`memsafe.cache`). Raises
    :class:`MemoryLimitError` when no rewrite brings the footprint under the limit."""
    closed, out_tree = _trace(flat_fun, avals, name)
    start = None if rewrite_from is None else _trace(rewrite_from, avals, name)[0]
    settings = (*_settings(memory_limit, donate, compiler_options, start), on_mesh)
    key = cache.program_key(closed, avals, settings)
    found = cache.PROGRAMS.get(key)
    if found is not None:
        log.reused(name)
        return _adopted(found, flat_fun, out_tree, compiler_options, donate)
    program = _search(
        flat_fun, closed, start, avals, memory_limit, donate, name, compiler_options, on_mesh
    )
    program.out_tree = out_tree
    cache.PROGRAMS.put(key, program, (closed, start, settings))
    return program


def _settings(
    memory_limit: int,
    donate: tuple[int, ...],
    compiler_options: Mapping[str, Any] | None,
    start: _jax.ClosedJaxpr | None,
) -> tuple[Any, ...]:
    """What a plan depends on besides the traced program (for :func:`cache.program_key`)."""
    options = tuple(sorted((k, repr(v)) for k, v in merged_options(compiler_options).items()))
    rewrite = None if start is None else cache.program_key(start, (), ())
    rules = tuple(registered_rules())  # user rules, hashed by identity
    return (memory_limit, donate, options, rules, jax.default_backend(), rewrite)


def _adopted(
    found: Program,
    flat_fun: Callable[..., Any],
    out_tree: Any,
    compiler_options: Mapping[str, Any] | None,
    donate: tuple[int, ...],
) -> Program:
    """A cached program for this caller: its output tree, and where the original program runs
    unchanged, this caller's function (what runs inside an outer trace, or through jit for
    argument types the executable refuses)."""
    found.out_tree = out_tree
    if found.plan.fits_unchanged:
        found.fun = flat_fun
        found.jitted = memsafe_jit(ordered(flat_fun), compiler_options, donate_argnums=donate)
    return found


def _search(
    flat_fun: Callable[..., Any],
    closed: _jax.ClosedJaxpr,
    start: _jax.ClosedJaxpr | None,
    avals: Sequence[jax.ShapeDtypeStruct],
    memory_limit: int,
    donate: tuple[int, ...],
    name: str,
    compiler_options: Mapping[str, Any] | None,
    on_mesh: mesh.MeshPlan | None = None,
) -> Program:
    """The original program when it fits, else the rewrite of ``start`` (default ``closed``)
    with the largest chunks that compile under the limit (per device, sharded, on a mesh).

    Where the original is estimated well over the limit, it compiles in a worker thread while
    the first attempt is planned and compiled, from the fixed bytes its arguments and outputs
    are expected to take; the attempt is used only if the original does not fit and its fixed
    bytes are the ones expected, so the outcome is the one of compiling first and planning
    after."""
    hidden = hidden_constant_bytes(closed.consts)
    search = _Search(
        start or closed, avals, memory_limit, donate, name, compiler_options, hidden, on_mesh
    )
    peak = estimate(Graph(closed)).peak_bytes
    guess = None if on_mesh is not None else _speculative_fixed(closed, donate, memory_limit, peak)
    what = (name, "original program", memory_limit)
    # expected over the limit: compiled to be measured, without allocating (GPU autotuning)
    options = measuring_options(compiler_options) if peak > memory_limit else compiler_options
    compiling = _Compiling(
        flat_fun, avals, options, donate, hidden, what, background=guess is not None
    )
    first = None if guess is None else search.attempt_or_none(guess)
    original = compiling.result()
    plan = Plan(memory_limit=memory_limit, before=original.footprint)
    out_tree = None  # set by build_program
    if original.footprint.total <= memory_limit:

        def compiler(suffix: str) -> Callable[[Any], _Compiled]:
            """A compile of the original program with other options (logged with ``suffix``)."""
            again = (name, f"original program, {suffix}", memory_limit)
            return lambda o: _compile(flat_fun, avals, o, donate, hidden, again)

        if options is not compiler_options:  # compiled to measure: now compiled to run
            original = _tuned(original, compiler_options, memory_limit, compiler("tuned"))
        plan.fits_unchanged = True
        plan.after = original.footprint
        plan.attempts.append(Attempt(1.0, original.footprint, True, "original program"))
        program = Program(
            original.jitted, flat_fun, tuple(avals), out_tree, plan, closed, original.compiled
        )
        candidate = compiler("candidate options")
        return _with_trial(program, candidate, compiler_options, compiler_options, name)
    if on_mesh is None:
        fixed = _check_fixed(original.footprint, memory_limit, name)
    else:
        fixed = on_mesh.check_fixed(original.footprint, avals, memory_limit, name)
    return search.run(plan, fixed, first if guess == fixed else None)


#: The original program is compiled beside the first attempt when its estimated peak exceeds
#: the limit by this factor (below, it may well fit, and the attempt would be wasted work).
SPECULATE_ABOVE = 1.5


def _speculative_fixed(
    closed: _jax.ClosedJaxpr, donate: tuple[int, ...], memory_limit: int, peak: int
) -> int | None:
    """The arguments' and outputs' bytes as XLA counts them on this backend (a tuple of
    outputs adds a pointer each), when the original's estimated ``peak`` is over
    SPECULATE_ABOVE times the limit, nothing is donated and those bytes fit the limit; else None
    (no speculation: where they exceed it, the original's compile ends in a refusal, and an
    attempt planned without room can be a program XLA is slow to compile: on an H100, the
    one-GPU kNN check's first attempt under 96 MiB, with its 256 MiB database, compiled for
    over 190 s where the original compiled in 0.2 s)."""
    if donate or peak <= SPECULATE_ABOVE * memory_limit:
        return None
    arguments = sum(_jax.nbytes_of_aval(v.aval) for v in closed.jaxpr.invars)
    outs = closed.jaxpr.outvars
    table = 8 * len(outs) if len(outs) > 1 else 0
    fixed = arguments + sum(_jax.nbytes_of_aval(v.aval) for v in outs) + table
    return fixed if fixed <= memory_limit else None


@dataclass
class _Tried:
    """One attempt: the rewritten program, its compile, its plan and what blocked splits."""

    program: _jax.ClosedJaxpr
    emitted: Callable[..., Any]
    got: _Compiled
    plan: Plan
    blockers: list
    scale: float
    placed: tuple  # the argument avals compiled for (placed on a mesh)
    what: tuple[str, str, int]  # name, description, limit (for the log)
    options: Mapping[str, Any] | None  # the compiler options it runs with (see loop_options)


class _Search:
    """The passes run at shrinking chunk scales until a compile fits the limit."""

    def __init__(
        self,
        start: _jax.ClosedJaxpr,
        avals: Sequence[jax.ShapeDtypeStruct],
        memory_limit: int,
        donate: tuple[int, ...],
        name: str,
        compiler_options: Mapping[str, Any] | None,
        hidden: int,
        on_mesh: mesh.MeshPlan | None = None,
    ) -> None:
        self.flat = inline_calls(start)
        self.avals, self.limit, self.donate, self.name = avals, memory_limit, donate, name
        self.options, self.hidden = compiler_options, hidden
        self.on_mesh = on_mesh
        self.roll, self.rolled = True, False  # see run

    def attempt(
        self, index: int, scale: float, fixed: int, previous: list | None = None
    ) -> _Tried | None:
        """The passes at chunk ``scale`` given ``fixed`` bytes, then the compile; None, with
        nothing compiled, when the passes did what they did in the ``previous`` attempt (its
        records: the same program)."""
        attempt_plan = Plan(memory_limit=self.limit)
        ctx = PassContext(
            self.limit, fixed + self.hidden, attempt_plan, chunk_scale=scale, roll=self.roll
        )
        sharding = None if self.on_mesh is None else self.on_mesh.sharding()
        ctx.mesh = sharding  # records where the sharded loops want the inputs placed
        program = self.flat
        for pass_name, run in passes.named_passes():
            program = _run_logged(pass_name, run, program, ctx, self.name)
        self.rolled |= any(getattr(r, "pass_name", "") == "roll" for r in attempt_plan.records)
        if previous is not None and attempt_plan.records == previous:
            return None
        emitted = _emit(program)
        what = (self.name, f"attempt {index + 1} (chunk scale {scale:.3g})", self.limit)
        hidden_now = hidden_constant_bytes(program.consts)
        placed = tuple(self.avals if sharding is None else sharding.placed(self.avals))
        options = loop_options(self.options, _jax.dtypes_in(program.jaxpr))
        # over the limit or not, this compile allocates nothing of the program's size
        measure = measuring_options(options)
        got = _compile(emitted, placed, measure, self.donate, hidden_now, what)
        return _Tried(
            program, emitted, got, attempt_plan, ctx.blockers, scale, placed, what, options
        )

    def attempt_or_none(self, fixed: int) -> _Tried | None:
        """The first attempt, or None where it fails (raised again, if the original does not
        fit, when the attempt is made in turn)."""
        try:
            return self.attempt(0, 1.0, fixed)
        except Exception:  # the original may fit: then the rewrite's failure does not matter
            return None

    def _compiler(self, tried: _Tried, suffix: str) -> Callable[[Any], _Compiled]:
        """A compile of ``tried``'s program with other options (logged with ``suffix``)."""
        hidden = hidden_constant_bytes(tried.program.consts)
        name, description, limit = tried.what
        what = (name, f"{description}, {suffix}", limit)

        def compile_with(options: Mapping[str, Any] | None) -> _Compiled:
            return _compile(tried.emitted, tried.placed, options, self.donate, hidden, what)

        return compile_with

    def _tuned(self, tried: _Tried) -> _Compiled:
        """The attempt that fits, compiled to run (see :func:`_tuned`)."""
        return _tuned(tried.got, tried.options, self.limit, self._compiler(tried, "tuned"))

    def _with_trial(self, program: Program, tried: _Tried) -> Program:
        """``program`` (of ``tried``) with a trial of other compile options (see
        :func:`_with_trial`)."""
        compile_with = self._compiler(tried, "candidate options")
        return _with_trial(program, compile_with, tried.options, self.options, self.name)

    def _grown(
        self,
        index: int,
        scale: float,
        fixed: int,
        tried: _Tried,
        plan: Plan,
        over: tuple[float, int] | None = None,
    ) -> _Tried:
        """``tried`` (which fits), or an attempt at a larger chunk scale that fits too, where
        ``tried`` split at the smallest chunks with most of the room unused (GROW_BELOW), or
        followed an attempt over the limit (``over``: its scale and temporaries) and left much
        of the room unused (REFILL_BELOW); the larger attempt is kept only where its splits run
        fewer loop iterations (at a larger scale the passes may choose other splits: a tiled
        top_k's 7 iterations became 10 of a query split).

        The first larger scale assumes the temporaries grow with the scale, or interpolates
        between ``tried`` and ``over``; where that attempt is over the limit, a second one
        interpolates between the two footprints measured."""
        room = self.limit - fixed
        low = (scale, tried.got.footprint.total - fixed)
        if any(s.floored for s in tried.plan.splits) and low[1] < GROW_BELOW * room:
            up = scale * min(GROW_MAX, SHRINK_MARGIN * room / max(low[1], 1))
            if over is not None:  # no further than the scale measured over the limit says
                up = min(up, _between(low, over, SHRINK_MARGIN * room))
            note, tries = "grown: the smallest chunks fit", 2
        elif over is not None and low[1] < REFILL_BELOW * room:
            up = _between(low, over, SHRINK_MARGIN * room)
            note, tries = "grown: between the last two attempts", 1
        else:
            return tried
        for step in range(tries):
            if index + 1 + step >= MAX_ATTEMPTS:
                break
            bigger = self.attempt(index + 1 + step, up, fixed, tried.plan.records)
            if bigger is None:  # the passes did the same at the larger scale
                break
            after = bigger.got.footprint
            fits = after.total <= self.limit
            plan.attempts.append(Attempt(up, after, fits, note))
            if fits:  # kept where its loops run fewer iterations (it may split otherwise)
                return bigger if _iterations(bigger) < _iterations(tried) else tried
            up = _between(low, (up, after.total - fixed), SHRINK_MARGIN * room)
        return tried

    def run(self, plan: Plan, fixed: int, first: _Tried | None) -> Program:
        """The first attempt that fits (see :meth:`attempts`). Where none does and the roll
        pass rolled repeated blocks into scans, the program as written is planned again without
        rolling (a scan can stop a split the unrolled blocks allow: a ResNet's batch-norm
        stages); raises the MemoryLimitError of the two that came closer."""
        try:
            return self.attempts(plan, fixed, first)
        except MemoryLimitError as rolled:
            if not self.rolled:
                raise
            self.roll = False
            try:
                return self.attempts(plan, fixed, None)
            except MemoryLimitError as unrolled:
                raise min(rolled, unrolled, key=_closeness) from None

    def attempts(self, plan: Plan, fixed: int, first: _Tried | None) -> Program:
        """The first attempt that fits (``first``, made already, or planned now), recorded in
        ``plan``; raises MemoryLimitError when none does, with the footprint and blockers of
        the attempt that came closest."""
        scale, last, closest, previous, over = 1.0, None, None, None, None
        for index in range(MAX_ATTEMPTS):
            if index == 0 and first is not None:
                last = first
            else:
                last = self.attempt(index, scale, fixed, previous)
            if last is None:  # the same program as the last compile: shrink further
                scale *= 0.5
                continue
            after = last.got.footprint
            fits = after.total <= self.limit
            plan.attempts.append(Attempt(scale, after, fits))
            if closest is None or after.total < closest.got.footprint.total:
                closest = last
            if fits:
                last = self._grown(index, scale, fixed, last, plan, over)
                got = self._tuned(last)
                plan.records, plan.after = last.plan.records, got.footprint
                program = Program(
                    got.jitted, last.emitted, last.placed, None, plan, last.program, got.compiled
                )
                return self._with_trial(program, last)
            # even where nothing was split, a smaller budget may make the passes act: their
            # size model can count less than XLA keeps (the 4-block GPT gradient at L=2048:
            # 431 MiB modelled, 803 MiB compiled, nothing split under 497 MiB of budget)
            previous, over = last.plan.records, (scale, after.total - fixed)
            scale = _next_scale(scale, index, after, self.limit, fixed)
        best = None if closest is None else closest.got.footprint
        blockers = [] if closest is None else closest.blockers
        raise _refusal(self.flat, self.name, self.limit, plan.before, best, blockers)


def _iterations(tried: _Tried) -> int:
    """Loop iterations an attempt's splits run, all together."""
    return sum(r.loops for r in tried.plan.splits)


def _between(low: tuple[float, int], high: tuple[float, int], target: float) -> float:
    """The chunk scale whose temporaries reach ``target``, linear between two attempts'
    (scale, temporaries)."""
    return low[0] + (high[0] - low[0]) * (target - low[1]) / max(high[1] - low[1], 1)


def _closeness(err: MemoryLimitError) -> float:
    """How far a refused plan stayed over its limit: its best footprint (none: the worst)."""
    return float("inf") if err.footprint is None else err.footprint


class MemsafeFunction:
    """A function compiled under a memory limit; call it like a ``jax.jit`` function.

    Made by :func:`memsafe.jit`, whose arguments it keeps as attributes (``memory_limit`` in
    bytes). ``__wrapped__`` is the original function; name and docstring are copied from it.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        memory_limit: int | float | str,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (),
        donate_argnames: str | Sequence[str] = (),
        compiler_options: Mapping[str, Any] | None = None,
        progress: bool | None = None,
        mesh: Any = None,
    ) -> None:
        self.fun = fun
        self.mesh = mesh
        self.memory_limit = parse_limit(memory_limit)
        self._spec = ArgSpec.infer(
            fun, static_argnums, static_argnames, donate_argnums, donate_argnames
        )
        self.static_argnums = self._spec.static_argnums
        self.static_argnames = self._spec.static_argnames
        self.donate_argnums = self._spec.donate_argnums
        self.donate_argnames = self._spec.donate_argnames
        self.compiler_options = dict(compiler_options or {})
        self.progress = progress
        self._build_options = {"compiler_options": self.compiler_options, "progress": progress}
        self._programs: dict[Any, Program] = {}
        self._backward: dict[Any, Program] = {}
        self._latest_backward: dict[Any, Program] = {}
        self._batched_programs: dict[Any, BatchedProgram] = {}
        self._warned = [False]  # the outer-jit warning, given once (memsafe.batching)
        static = self._spec.static_argnums or self._spec.static_argnames
        self._fast = None if static else FastPath()  # calls of programs already verified
        functools.update_wrapper(self, fun)

    # -- argument handling -------------------------------------------------------------------

    def _planned(self, args: tuple, kwargs: dict) -> tuple[Program, Call]:
        """The verified program for this call's arguments (planned on first sight), and the call."""
        call = self._spec.split(args, kwargs)
        on_mesh = self._on_mesh(call.flat)
        program = self._programs.get(self._key(call, on_mesh))
        if program is None:
            avals = call.avals if on_mesh is None else on_mesh.given(call.avals, call.flat)
            program = build_program(
                call.rebuild,
                avals,
                self.memory_limit,
                call.donate,
                self._name,
                on_mesh=on_mesh,
                **self._build_options,
            )
            program.out_tree = call.out_tree[0]  # the user's output structure
            program.on_mesh = on_mesh
            self._programs[self._key(call, on_mesh)] = program
        return program, call

    def _on_mesh(self, flat: Sequence[Any]) -> mesh.MeshPlan | None:
        """The mesh this call runs on (memsafe.mesh.resolve), None for one device."""
        found = mesh.resolve(self.mesh, flat)
        return None if found is None else mesh.MeshPlan(found)

    @staticmethod
    def _key(call: Call, on_mesh: mesh.MeshPlan | None) -> Any:
        return call.key if on_mesh is None else (call.key, on_mesh)

    def _program(self, args: tuple, kwargs: dict) -> tuple[Program, list[Any], Callable, Any]:
        program, call = self._planned(args, kwargs)
        return program, call.flat, call.rebuild, self._key(call, program.on_mesh)

    @property
    def _name(self) -> str:
        return getattr(self.fun, "__name__", repr(self.fun))

    # -- public API --------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fast is not None:
            outs = self._fast.call(args, kwargs)
            if outs is not MISS:
                return outs
        program, flat, rebuild, key = self._program(args, kwargs)
        if any(_jax.is_forward_mode_tracer(x) for x in flat):
            raise ForwardModeError(self._name)
        if any(_jax.is_tracer(x) for x in flat):
            outs = self._differentiable(program, rebuild, key)(*flat)
        else:
            outs = program.run(flat)
            if self._fast is not None and program.on_mesh is None and program.settled:
                self._fast.remember(args, kwargs, program)  # (a mesh places arguments)
        return jax.tree_util.tree_unflatten(program.out_tree, list(outs))

    def __repr__(self) -> str:
        parts = [self._name, f"memory_limit={format_bytes(self.memory_limit)}"]
        for attr in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames"):
            if getattr(self, attr):
                parts.append(f"{attr}={getattr(self, attr)!r}")
        if self.compiler_options:
            parts.append(f"compiler_options={self.compiler_options!r}")
        plans = len(self._programs)
        parts.append(f"{plans} plan{'s' if plans != 1 else ''}")
        return f"memsafe.jit({', '.join(parts)})"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """As a method: bind ``obj`` as the first argument, as ``jax.jit`` functions do."""
        if obj is None:
            return self
        return functools.partial(self, obj)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """What was done for these arguments (arrays or ShapeDtypeStructs).

        Args:
            *args: the arguments as for a call; arrays may be ``jax.ShapeDtypeStruct``.
            **kwargs: keyword arguments as for a call.

        Returns:
            The :class:`memsafe.Plan` (with ``backward`` set once a gradient was planned).

        Raises:
            memsafe.MemoryLimitError: no rewrite meets the limit.
        """
        program, _, _, key = self._program(args, kwargs)
        backward = self._latest_backward.get(key)
        if backward is not None:
            program.plan.backward = backward.plan
        return program.plan

    def trace(self, *args: Any, **kwargs: Any) -> stages.Traced:
        """Trace and plan for these arguments, as ``jax.jit(f).trace`` (the program is verified,
        so this compiles it). ``.jaxpr`` is the program that runs; ``.lower()`` continues.

        Example:
            >>> traced = f_safe.trace(x, k=10)
            >>> compiled = traced.lower().compile()
            >>> compiled(x)   # static arguments left out, as in JAX (or repeated)
        """
        program, call = self._planned(args, kwargs)
        return stages.Traced(self._spec, call, program)

    def lower(self, *args: Any, **kwargs: Any) -> stages.Lowered:
        """The verified program lowered for these arguments, as ``jax.jit(f).lower``;
        ``.compile()`` returns the executable memsafe measured, called with the same pytrees."""
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The outputs' shapes and dtypes (``jax.ShapeDtypeStruct`` pytree), as
        ``jax.eval_shape``: traced only, nothing is planned or compiled."""
        call = self._spec.split(args, kwargs)
        outs = jax.eval_shape(call.rebuild, *call.avals)
        return jax.tree_util.tree_unflatten(call.out_tree[0], outs)

    def backward_plan(
        self, *args: Any, argnums: int | Sequence[int] | None = None, **kwargs: Any
    ) -> Plan:
        """The plan of the gradient program for these arguments.

        Args:
            *args: the arguments as for a call; arrays may be ``jax.ShapeDtypeStruct``.
            argnums: the positional arguments differentiated, as ``jax.grad``'s ``argnums``.
                Left out: the gradient program that ran last for these arguments (the inputs
                ``jax.grad`` perturbed, the cotangents it passed), or, before any ran, the
                gradient w.r.t. every floating-point input.
            **kwargs: keyword arguments as for a call.

        Returns:
            The :class:`memsafe.Plan` of the backward program.

        Raises:
            memsafe.MemoryLimitError: no rewrite meets the limit.
            ValueError: ``argnums`` names no dynamic positional argument.
        """
        program, _, rebuild, key = self._program(args, kwargs)
        if argnums is None:
            ran = self._latest_backward.get(key)
            return (ran or self._backward_program(program, rebuild, key)).plan
        perturbed = self._spec.flags(args, kwargs, argnums)
        return self._backward_program(program, rebuild, key, perturbed).plan

    # -- differentiation ---------------------------------------------------------------------

    def _backward_program(
        self,
        program: Program,
        rebuild: Callable,
        key: Any,
        perturbed: tuple[bool, ...] | None = None,
        nonzero: tuple[bool, ...] | None = None,
    ) -> Program:
        """The VJP program, itself rewritten and verified under the memory limit: gradients of
        the ``perturbed`` float inputs (default all) from the ``nonzero`` output cotangents
        (default all), which are its arguments after the primal inputs."""
        avals = program.avals
        outvars = program.closed.jaxpr.outvars
        perturbed = perturbed or (True,) * len(avals)
        nonzero = nonzero or (True,) * len(outvars)
        found = self._backward.get((key, perturbed, nonzero))
        if found is not None:
            return found
        out_avals = [
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
            for v, keep in zip(outvars, nonzero)
            if keep
        ]
        diff = [
            i
            for i, (a, p) in enumerate(zip(avals, perturbed))
            if p and jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)
        ]
        n_in = len(avals)

        forward, rewrites = _algebraic_forward(rebuild, avals, self.memory_limit)

        def vjp_of(forward: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
            def vjp_fun(*flat: Any) -> list[Any]:
                primals, given = flat[:n_in], iter(flat[n_in:])
                cts = [
                    next(given) if keep else jax.numpy.zeros(v.aval.shape, v.aval.dtype)
                    for v, keep in zip(outvars, nonzero)
                ]

                def of_diff(*d: Any) -> list[Any]:
                    full = list(primals)
                    for i, v in zip(diff, d):
                        full[i] = v
                    return forward(*full)

                _, pullback = jax.vjp(of_diff, *[primals[i] for i in diff])
                return list(pullback(cts))

            return vjp_fun

        # The original gradient when it fits; the rewritten forward's only where memory needs it.
        backward = build_program(
            vjp_of(rebuild),
            (*avals, *out_avals),
            self.memory_limit,
            (),
            f"gradient of {self._name}",
            rewrite_from=vjp_of(forward),
            on_mesh=program.on_mesh,
            **self._build_options,
        )
        if not backward.plan.fits_unchanged:
            backward.plan.records[:0] = rewrites
        backward.diff_positions = diff  # type: ignore[attr-defined]
        backward.source = vjp_of(rebuild)  # re-planned under vmap from the original gradient
        self._backward[(key, perturbed, nonzero)] = backward
        self._latest_backward[key] = backward  # shown by plan()
        return backward

    def _batched(self, program: Program, source: Callable, key: Any) -> BatchedProgram:
        """``program``, planned from ``source``, as a :class:`BatchedProgram` (re-planned under
        ``jax.vmap``), cached."""
        found = self._batched_programs.get(key)
        if found is None or found.program is not program:
            found = BatchedProgram(source, program, self._build, self._name, self._warned)
            self._batched_programs[key] = found
        return found

    def _build(self, flat_fun: Callable, avals: Sequence[Any], name: str) -> Program:
        return build_program(flat_fun, avals, self.memory_limit, (), name, **self._build_options)

    def _differentiable(self, program: Program, rebuild: Callable, key: Any) -> Callable:
        """The program as a custom_vjp whose backward pass is its own memory-safe program, and
        whose forward and backward re-plan under ``jax.vmap`` (memsafe.gradient)."""

        def backward_for(
            perturbed: tuple[bool, ...], nonzero: tuple[bool, ...]
        ) -> tuple[BatchedProgram, list[int]]:
            backward = self._backward_program(program, rebuild, key, perturbed, nonzero)
            batched = self._batched(
                backward, backward.source, ("backward", key, perturbed, nonzero)
            )
            return batched, backward.diff_positions  # type: ignore[attr-defined]

        return differentiable(self._batched(program, rebuild, key), backward_for)


@planning
def _algebraic_forward(
    fun: Callable[..., Any], avals: Sequence[jax.ShapeDtypeStruct], memory_limit: int
) -> tuple[Callable[..., list[Any]], list[Any]]:
    """``fun`` with the algebraic passes applied and custom derivative rules kept, ready to
    differentiate; and the records of the rewrites that fired."""
    closed, _ = _jax.make_closed_jaxpr(fun, avals)
    program = inline_calls(closed, keep_custom_derivatives=True)
    ctx = PassContext(
        memory_limit=memory_limit,
        fixed_bytes=0,
        plan=Plan(memory_limit),
        keep_custom_derivatives=True,
    )
    for name, run in passes.named_passes():
        if name in ALGEBRAIC_PASSES:
            program = _run_pass(name, run, program, ctx, getattr(fun, "__name__", "function"))
    return _emit(program), ctx.plan.records


def strict() -> bool:
    """Whether a failing pass is an error (``MEMSAFE_STRICT=1``, as the test suite sets) rather
    than skipped with a warning."""
    return os.environ.get("MEMSAFE_STRICT") == "1"


def _run_pass(
    pass_name: str, run: Callable[..., Any], program: Any, ctx: PassContext, fun_name: str
) -> Any:
    """Run one pass; a pass that fails on a program it does not understand is skipped with a
    warning (passes only optimize: the program before it is still correct), and the driver's
    verification decides whether what remains fits. Under :func:`strict` the failure is
    re-raised with a note naming the pass and the function."""
    try:
        return run(program, ctx)
    except Exception as err:  # any failure of an optimization is survivable
        if strict():
            err.add_note(f"memsafe: in pass '{pass_name}' on {fun_name} (MEMSAFE_STRICT=1)")
            raise
        warnings.warn(
            f"memsafe: pass '{pass_name}' failed on {fun_name} and was skipped "
            f"({type(err).__name__}: {err})",
            RuntimeWarning,
            stacklevel=3,
        )
        ctx.record(PassRecord(pass_name, f"skipped: {type(err).__name__}: {err}"))
        return program


def jit(
    fun: Callable[..., Any] | None = None,
    *,
    memory_limit: int | float | str,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    compiler_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    mesh: Any = None,
) -> Any:
    """Compile ``fun`` so that its whole footprint (arguments + outputs + temporaries - aliases +
    constants) stays under ``memory_limit``, splitting large intermediates into sequential chunks.

    Usable as ``memsafe.jit(f, memory_limit="1GiB")`` or as a decorator with keyword arguments.

    Args:
        fun: the function, as for ``jax.jit``; omit it to get a decorator.
        memory_limit: bytes (an int, or a float that is a whole number) or a size string
            (``"512MiB"``, ``"2GB"``, ``"1.5GiB"``); see :func:`memsafe.parse_limit`.
        static_argnums: positions of arguments that are hashable Python values; completed with
            their names through ``fun``'s signature, as ``jax.jit`` does, so they may be passed
            by position or keyword.
        static_argnames: names of static arguments, completed with their positions likewise.
        donate_argnums: positions of arguments whose buffers XLA may reuse for outputs.
        donate_argnames: names of donated arguments.
        compiler_options: XLA options for every compile, merged with memsafe's (on the CPU,
            YNNPACK fusions off); an option given here wins over memsafe's.
        progress: show a one-line progress display on stderr for plans longer than about two
            seconds; None (default) reads the environment variable ``MEMSAFE_PROGRESS=1``.
        mesh: a ``jax.sharding.Mesh`` to run on, with ``memory_limit`` per device: the split
            axes are sharded over its devices (memsafe.mesh). None (default): the mesh set
            with ``jax.set_mesh``, else the one the arguments' ``NamedSharding`` carry, else
            one device.

    Returns:
        A :class:`MemsafeFunction` (or, without ``fun``, a decorator making one).

    Raises:
        TypeError: ``fun`` is not callable, or an argnum/argname has the wrong type.
        ValueError: a bad ``memory_limit``, or an argnum/argname ``fun`` has no parameter for.
        memsafe.MemoryLimitError: (at the first call for some argument shapes) no rewrite meets
            the limit.

    Example:
        >>> knn_safe = memsafe.jit(knn, memory_limit="1GiB", static_argnames="k")
        >>> dist, idx = knn_safe(x, y, k=10)
    """
    options = {
        "memory_limit": memory_limit,
        "static_argnums": static_argnums,
        "static_argnames": static_argnames,
        "donate_argnums": donate_argnums,
        "donate_argnames": donate_argnames,
        "compiler_options": compiler_options,
        "progress": progress,
        "mesh": mesh,
    }
    if fun is None:
        parse_limit(memory_limit)  # a bad limit is an error at the decorator already
        return functools.partial(jit, **options)
    if not callable(fun):
        raise TypeError(f"memsafe.jit expects a callable, got {type(fun).__name__}")
    return MemsafeFunction(fun, **options)


def _run_logged(
    pass_name: str, run: Callable[..., Any], program: Any, ctx: PassContext, fun_name: str
) -> Any:
    """:func:`_run_pass`, logged at DEBUG with the records it added, the estimated peak before
    and after (estimated only when the log is at DEBUG) and its time."""
    watch = log.Stopwatch()
    n_records = len(ctx.plan.records)
    debug = log.logger.isEnabledFor(logging.DEBUG)
    before = estimate(Graph(program)).peak_bytes if debug else 0
    out = _run_pass(pass_name, run, program, ctx, fun_name)
    peaks = (before, estimate(Graph(out)).peak_bytes) if debug else None
    log.pass_done(fun_name, pass_name, ctx.plan.records[n_records:], peaks, watch.elapsed)
    return out
