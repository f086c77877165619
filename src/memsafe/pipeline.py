"""Running the passes over a program: each pass in order, a failing one skipped (or, under
:func:`strict`, raised), each logged with what it recorded and its time."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

from memsafe import log
from memsafe.context import PassContext
from memsafe.graph import Graph, estimate
from memsafe.plan import PassRecord

#: A pass: (program, context) -> program.
Run = Callable[[Any, PassContext], Any]


def strict() -> bool:
    """Whether a failing pass is an error (``MEMSAFE_STRICT=1``, as the test suite sets) rather
    than skipped with a warning."""
    return os.environ.get("MEMSAFE_STRICT") == "1"


def run_pass(pass_name: str, run: Run, program: Any, ctx: PassContext, fun_name: str) -> Any:
    """Run one pass; a pass that fails on a program it does not understand is skipped with a
    warning (passes only optimize: the program before it is still correct), and the driver's
    verification decides whether what remains fits. Under :func:`strict` the failure is
    re-raised with a note naming the pass and the function.

    Args:
        pass_name: the pass's name (recorded, and in the warning).
        run: the pass.
        program: the ClosedJaxpr it rewrites.
        ctx: the context the passes share (limit, plan records, chunk scale).
        fun_name: the function planned (in the warning).

    Returns:
        The rewritten program, or ``program`` where the pass failed.
    """
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


def run_logged(pass_name: str, run: Run, program: Any, ctx: PassContext, fun_name: str) -> Any:
    """:func:`run_pass`, logged at DEBUG with the records it added, the estimated peak before
    and after (estimated only when the log is at DEBUG) and its time."""
    watch = log.Stopwatch()
    n_records = len(ctx.plan.records)
    debug = log.logger.isEnabledFor(logging.DEBUG)
    before = estimate(Graph(program)).peak_bytes if debug else 0
    out = run_pass(pass_name, run, program, ctx, fun_name)
    peaks = (before, estimate(Graph(out)).peak_bytes) if debug else None
    log.pass_done(fun_name, pass_name, ctx.plan.records[n_records:], peaks, watch.elapsed)
    return out


def run_passes(
    passes: Iterable[tuple[str, Run]],
    program: Any,
    ctx: PassContext,
    fun_name: str,
    seconds: dict[str, float] | None = None,
) -> Any:
    """``program`` rewritten by each of ``passes`` ((name, run) pairs) in order, each through
    :func:`run_logged`; each pass's time is added to ``seconds[name]`` where given."""
    for pass_name, run in passes:
        watch = log.Stopwatch()
        program = run_logged(pass_name, run, program, ctx, fun_name)
        if seconds is not None:
            seconds[pass_name] = seconds.get(pass_name, 0.0) + watch.elapsed
    return program
