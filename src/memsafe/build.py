"""Building a verified program: trace, reuse a program planned before (:mod:`memsafe.cache`),
else search for one that fits (:mod:`memsafe.search`)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from memsafe import _jax, cache, log, stored
from memsafe.batching import planning
from memsafe.errors import MemoryLimitError
from memsafe.fused import policy
from memsafe.lapack_order import ordered
from memsafe.plan import PlanTime
from memsafe.program import Program
from memsafe.progress import display as progress_display
from memsafe.progress import enabled as progress_enabled
from memsafe.rules.registry import registered_rules
from memsafe.search import Hint, search
from memsafe.split.strategies.sharded import mesh
from memsafe.xla import memsafe_jit, merged_options, start_probe


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
            time = program.plan.time
            if program.origin != "planned":  # (a search says whether it re-sized)
                time.origin = program.origin
            time.total = watch.elapsed
            log.finished(name, len(program.plan.attempts), True, time.describe())
        return program

    return run


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
    hint: Hint | None = None,
) -> Program:
    """Trace ``flat_fun`` at ``avals`` and return a program verified to fit ``memory_limit``.

    The original program is returned, unchanged, when it fits. Otherwise the passes rewrite
    ``rewrite_from`` (default ``flat_fun``; an equivalent start, such as the gradient of an
    algebraically rewritten forward), shrinking chunks until a compile fits. ``compiler_options``
    are the user's, merged with memsafe's (see ``xla.merged_options``). With ``on_mesh`` the
    limit is per device, ``avals`` carry the arguments' placement for the original program, and
    the split axes are sharded over the mesh (memsafe.split.strategies.sharded.mesh). A program
    traced the same under the same settings before, by any memsafe function, is reused
    (:mod:`memsafe.cache`), and one another process planned is loaded where the plan store is on
    (:mod:`memsafe.stored`); a ``hint`` from the plan at other shapes shortens the search
    (:class:`memsafe.search.Hint`). Raises :class:`MemoryLimitError` when no rewrite brings the
    footprint under the limit."""
    watch = log.Stopwatch()
    start_probe()  # memsafe's compiler options known while the function is traced
    closed, out_tree = trace(flat_fun, avals, name)
    start = None if rewrite_from is None else trace(rewrite_from, avals, name)[0]
    traced = watch.elapsed
    settings = (*_settings(memory_limit, donate, compiler_options, start), on_mesh)
    key = cache.program_key(closed, avals, settings)
    found = cache.PROGRAMS.get(key)
    if found is not None:
        log.reused(name)
        found.plan.time = PlanTime(trace=traced)  # (a copy of the plan: memsafe.cache.fresh)
        return _adopted(found, flat_fun, out_tree, compiler_options, donate)
    on_disk = stored.key_of(closed, start, avals, memory_limit, donate, compiler_options, on_mesh)
    program = (
        None
        if on_disk is None
        else stored.load(on_disk, avals, memory_limit, donate, out_tree, name)
    )
    if program is None:
        program = search(
            flat_fun,
            closed,
            start,
            avals,
            memory_limit,
            donate,
            name,
            compiler_options,
            out_tree,
            on_mesh,
            hint,
        )
        if on_disk is not None and not program.plan.fits_unchanged:
            stored.save(on_disk, program, name)
    program.plan.time.trace = traced
    cache.PROGRAMS.put(key, program, (closed, start, settings))
    return program


def trace(flat_fun: Callable[..., Any], avals: Sequence[Any], name: str) -> tuple[Any, Any]:
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
    fused = policy.in_effect()  # fused kernels (memsafe.fused), where on
    return (memory_limit, donate, options, rules, jax.default_backend(), rewrite, fused)


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
    if not found.plan.fits_unchanged:
        return dataclasses.replace(found, out_tree=out_tree, origin="reused")
    jitted = memsafe_jit(ordered(flat_fun), compiler_options, donate_argnums=donate)
    return dataclasses.replace(
        found, out_tree=out_tree, fun=flat_fun, jitted=jitted, origin="reused"
    )
