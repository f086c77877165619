"""Verified programs kept on disk (:mod:`memsafe.plan_store`), so that another process skips
the search: what one process planned, the next one loads (or compiles once) and checks.

An entry holds the program that ran, serialized with ``jax.export`` (its StableHLO), the
executable that ran (XLA's serialization, where the backend gives one), the compiler options it
ran with, its :class:`memsafe.Plan`, and whether it was worth a trial of other compile options.
It is keyed by the traced program (its text, its constants by content, argument shapes, dtypes
and weak types), the program a rewrite starts from, the limit, the donated arguments, the
compiler options and, through :func:`memsafe.plan_store.key`, memsafe's and jax's versions and
memsafe's source, the backend, its devices and their topology, the host processor (on the CPU
backend) and ``XLA_FLAGS``. The executable found is loaded, not compiled, and its footprint
measured again (its own ``memory_analysis()``): the program that runs is the one measured. Where
it does not load (another jaxlib, bytes cut short) the stored program is compiled and measured
instead, with a warning. An entry whose program no longer fits is ignored with a warning, and
the search runs as if nothing were stored. Programs on a mesh and programs planned while user
rules are registered (known by identity only) are not stored.

The payload is a pickle, and loading an executable runs the machine code it holds: an entry is
read only from the directory the user chose, whose files only the user can write (the store
creates them 0600, in a 0700 directory), and only after its checksum matches (a file altered on
disk is ignored whole, :mod:`memsafe.plan_store`).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from memsafe import _jax, log, plan_store
from memsafe.compiling import Compiled, add_trial, compile_measured
from memsafe.fused import policy
from memsafe.lapack_order import ordered
from memsafe.plan import PlanTime
from memsafe.program import Program
from memsafe.rules.registry import registered_rules
from memsafe.xla import Footprint, hidden_constant_bytes, memsafe_jit, merged_options


def key_of(
    closed: _jax.ClosedJaxpr,
    start: _jax.ClosedJaxpr | None,
    avals: Sequence[jax.ShapeDtypeStruct],
    memory_limit: int,
    donate: tuple[int, ...],
    compiler_options: Mapping[str, Any] | None,
    on_mesh: Any,
) -> str | None:
    """The store's key for a program planned under these settings, or None where it is not
    stored (the store off, a mesh, user rules registered, constants that cannot be read)."""
    if plan_store.cache_dir() is None or on_mesh is not None or registered_rules():
        return None
    options = sorted((k, repr(v)) for k, v in merged_options(compiler_options).items())
    try:
        return plan_store.key(
            program=plan_store.program_digest(closed, avals),
            start="" if start is None else plan_store.program_digest(start, avals),
            memory_limit=str(memory_limit),
            donate=repr(tuple(donate)),
            compiler_options=repr(options),
            **({} if (fused := policy.in_effect()) is None else {"fused": repr(fused)}),
        )
    except TypeError:  # a constant that cannot be read as an array
        return None


def load(
    key: str,
    avals: Sequence[jax.ShapeDtypeStruct],
    memory_limit: int,
    donate: tuple[int, ...],
    out_tree: Any,
    name: str,
) -> Program | None:
    """The program stored under ``key``, verified to fit ``memory_limit`` again, or None
    (nothing stored, an entry that does not load, or a program that no longer fits).

    The stored executable is loaded and measured where there is one that loads
    (:func:`_executable`); else the stored program is compiled and measured."""
    entry = plan_store.load(key)
    if entry is None:
        return None
    watch = log.Stopwatch()
    try:
        stored = pickle.loads(entry.payload)
        exported = jax.export.deserialize(stored["exported"])
        plan, options, hidden = stored["plan"], stored["options"], stored["hidden"]
        fun = exported.call
        got = _executable(stored.get("executable"), fun, avals, options, donate, hidden, name)
        if got is None:
            what = (name, "stored program", memory_limit)
            got = compile_measured(fun, avals, options, donate, hidden, what)
            plan.time = PlanTime(compiles=[("stored program", got.seconds)])
        else:
            total = got.footprint.total
            log.compiled(name, "stored executable", total, memory_limit, got.seconds, "loaded")
            plan.time = PlanTime(loaded=watch.elapsed)
        closed, _ = _jax.make_closed_jaxpr(fun, avals)
    except Exception as err:  # another jax's export, a payload that does not unpickle
        log.note(logging.WARNING, "%s: a stored plan did not load (%s); planning", name, err)
        return None
    if got.footprint.total > memory_limit:
        log.note(logging.WARNING, "%s: the stored plan no longer fits; planning", name)
        return None
    program = Program(
        got.jitted,
        fun,
        tuple(avals),
        out_tree,
        plan,
        closed,
        got.compiled,
        options=options,
        origin="loaded",
    )
    if not stored["trial"]:
        return program

    def compile_with(o: Mapping[str, Any] | None) -> Any:
        again = (name, "stored program, candidate options", memory_limit)
        return compile_measured(fun, avals, o, donate, hidden, again)

    return add_trial(program, compile_with, options, name)


def _executable(
    data: bytes | None,
    fun: Any,
    avals: Sequence[jax.ShapeDtypeStruct],
    options: Mapping[str, Any] | None,
    donate: tuple[int, ...],
    hidden: int,
    name: str,
) -> Compiled | None:
    """The stored executable loaded and measured (its own ``memory_analysis()``, with the
    same rule as :func:`compile_measured`: the program that runs is the one measured), with
    ``fun`` jitted for what it cannot run (arguments to convert, an outer trace); or None where
    none was stored, or it does not load here or does not take ``avals`` with ``donate``
    donated (logged: the stored program is compiled instead)."""
    if data is None:
        return None
    watch = log.Stopwatch()
    try:
        compiled = _jax.load_executable(data)
        takes = [(a.shape, a.dtype, a.donated) for a in jax.tree.leaves(compiled.args_info)]
        want = [(tuple(a.shape), a.dtype, i in donate) for i, a in enumerate(avals)]
        if takes != want:
            raise ValueError(f"it takes {takes}, not {want}")
        footprint = Footprint.from_compiled(compiled, hidden)
    except Exception as err:  # truncated or corrupt bytes, another jaxlib's or machine's
        log.note(
            logging.WARNING,
            "%s: the stored executable did not load (%s: %s); compiling the stored program",
            name,
            type(err).__name__,
            err,
        )
        return None
    jitted = memsafe_jit(ordered(fun), options, donate_argnums=donate)
    return Compiled(jitted, compiled, footprint, watch.elapsed)


def save(key: str, program: Program, name: str) -> None:
    """Store ``program`` (verified) under ``key``; a program ``jax.export`` cannot serialize
    (a host callback, say) is not stored."""
    try:
        exported = jax.export.export(program.jitted)(*program.avals)
        payload = {
            "exported": exported.serialize(),
            "executable": _serialized(program.compiled, name),
            "plan": program.plan,
            "options": dict(program.options or {}),
            "hidden": hidden_constant_bytes(program.closed.consts),
            "trial": program.trial is not None,
        }
        data = pickle.dumps(payload)
    except Exception as err:  # what export refuses: the program is planned again next time
        log.note(logging.DEBUG, "%s: not stored (%s: %s)", name, type(err).__name__, err)
        return
    meta = {"name": name, "footprint": program.plan.after.total, "limit": program.plan.memory_limit}
    plan_store.save(key, data, meta)


def _serialized(compiled: Any, name: str) -> bytes | None:
    """``compiled`` as bytes (:func:`memsafe._jax.serialize_executable`), or None where it
    cannot be serialized (the stored program is then compiled by the next process)."""
    if compiled is None:
        return None
    try:
        return _jax.serialize_executable(compiled)
    except Exception as err:  # e.g. constants passed as arguments, a backend that cannot
        log.note(logging.DEBUG, "%s: executable not stored (%s: %s)", name, type(err).__name__, err)
        return None
