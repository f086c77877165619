"""Compiling a program with memsafe's options, measuring its footprint, and trials of other
compile options over a verified program's first calls."""

from __future__ import annotations

import contextvars
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from memsafe import _jax, log, tuning
from memsafe.lapack_order import ordered
from memsafe.program import Program
from memsafe.xla import Footprint, measuring_options, memsafe_jit, merged_options

#: What a compile is logged as: the function's name, a description, the memory limit.
What = tuple[str, str, int]


@dataclass(frozen=True)
class Compiled:
    """One program compiled and measured."""

    jitted: Any
    compiled: Any
    footprint: Footprint
    seconds: float = 0.0  # lowering and compiling, wall clock


#: Compiles a program with the given options (memsafe's merged in) and measures it.
CompileWith = Callable[[Mapping[str, Any] | None], Compiled]


class Compiling:
    """``fun`` lowered (here: tracing runs in the caller's thread, with its JAX settings) and
    compiled with memsafe's options, in a worker thread when ``background``; :meth:`result`
    waits for it and measures the footprint.

    Args:
        fun: the flat function to compile.
        avals: its arguments' shapes and dtypes (placed, on a mesh).
        options: the compiler options (memsafe's merged in by :func:`memsafe.xla.memsafe_jit`).
        donate: the donated argument positions.
        hidden: bytes of constants XLA's memory analysis does not count (added to the footprint).
        what: what the compile is logged as.
        background: compile in the worker thread (:func:`compile_pool`).
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        avals: Sequence[Any],
        options: Mapping[str, Any] | None,
        donate: tuple[int, ...],
        hidden: int,
        what: What,
        background: bool = False,
    ) -> None:
        self._watch = log.Stopwatch()
        self._jitted = memsafe_jit(ordered(fun), options, donate_argnums=donate)
        lowered = self._jitted.lower(*avals)
        self._hidden, self._what = hidden, what
        self._future: Future | None = None
        if background:
            job = functools.partial(contextvars.copy_context().run, lowered.compile)
            self._future = compile_pool().submit(job)
        else:
            self._compiled = lowered.compile()

    def result(self) -> Compiled:
        """The compiled program and its footprint (waiting for the worker, if it compiles)."""
        compiled = self._compiled if self._future is None else self._future.result()
        footprint = Footprint.from_compiled(compiled, self._hidden)
        name, what, memory_limit = self._what
        seconds = self._watch.elapsed
        log.compiled(name, what, footprint.total, memory_limit, seconds)
        return Compiled(self._jitted, compiled, footprint, seconds)


@functools.cache
def compile_pool() -> ThreadPoolExecutor:
    """The one worker that compiles an original program while its rewrite is planned."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="memsafe-compile")


def compile_measured(
    fun: Callable[..., Any],
    avals: Sequence[Any],
    options: Mapping[str, Any] | None,
    donate: tuple[int, ...],
    hidden: int,
    what: What,
) -> Compiled:
    """``fun`` compiled with memsafe's options and its footprint (see :class:`Compiling`)."""
    return Compiling(fun, avals, options, donate, hidden, what).result()


def tuned(
    measured: Compiled,
    options: Mapping[str, Any] | None,
    memory_limit: int,
    compile_with: CompileWith,
) -> Compiled:
    """The program that fits, compiled to run: ``measured`` (compiled with
    :func:`measuring_options`) where those are memsafe's usual ``options`` (the CPU); elsewhere
    ``compile_with(options)`` (a GPU's autotuner on, allocating now only what this program may),
    kept if it also fits ``memory_limit``, else ``measured``."""
    if measuring_options(options) == merged_options(options):
        return measured
    again = compile_with(options)
    return again if again.footprint.total <= memory_limit else measured


def with_trial(
    program: Program,
    compile_with: CompileWith,
    options: Mapping[str, Any] | None,
    user: Mapping[str, Any] | None,
    name: str,
) -> Program:
    """``program`` with a trial of :data:`memsafe.tuning.CANDIDATE` over its first calls, where
    worth it (:func:`memsafe.tuning.worth_tuning`; ``user``: the options the user gave, one they
    set is not tried otherwise); see :func:`add_trial`."""
    merged = merged_options(options)
    if program.compiled is None or not tuning.worth_tuning(program.closed, merged, user or {}):
        return program
    return add_trial(program, compile_with, options, name)


def add_trial(
    program: Program, compile_with: CompileWith, options: Mapping[str, Any] | None, name: str
) -> Program:
    """``program`` with a trial of :data:`memsafe.tuning.CANDIDATE` over its first calls: the
    candidate compiled by ``compile_with`` with ``options`` (the program's) updated."""

    def candidate(extra: dict[str, Any]) -> tuple[Any, Footprint] | None:
        try:
            got = compile_with({**dict(options or {}), **extra})
        except Exception:  # an option this jaxlib rejects: the verified executable stays
            return None
        return got.compiled, got.footprint

    trial = tuning.Trial(program.compiled, candidate, program.plan, name)
    return dataclasses.replace(program, trial=trial)


def emit(
    closed: _jax.ClosedJaxpr, out_avals: Sequence[Any] | None = None
) -> Callable[..., list[Any]]:
    """A plain JAX function that runs ``closed`` (used to jit and to differentiate); its results
    weakly typed where ``out_avals`` (the program's before it was rewritten) are."""

    def run(*flat: Any) -> list[Any]:
        outs = _jax.eval_jaxpr(closed.jaxpr, closed.consts, *flat)
        return outs if out_avals is None else _jax.weak_like(outs, out_avals)

    run.memsafe_closed = closed  # type: ignore[attr-defined]  # what it runs (lapack_order)
    return run
