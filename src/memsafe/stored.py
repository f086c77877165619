"""Verified programs kept on disk (:mod:`memsafe.plan_store`), so that another process skips
the search: what one process planned, the next one compiles once and checks.

An entry holds the program that ran, serialized with ``jax.export`` (its StableHLO), the compiler
options it ran with, its :class:`memsafe.Plan`, and whether it was worth a trial of other compile
options. It is keyed by the traced program (its text, its constants by content, argument shapes,
dtypes and weak types), the program a rewrite starts from, the limit, the donated arguments, the
compiler options and, through :func:`memsafe.plan_store.key`, memsafe's and jax's versions and
memsafe's source, the backend and its devices. A program found is compiled and its footprint
measured again: an entry whose program no longer fits is ignored with a warning, and the search
runs as if nothing were stored. Programs on a mesh and programs planned while user rules are
registered (known by identity only) are not stored.

The payload is a pickle: an entry is read only from the directory the user chose, whose files
only the user can write (the store creates them 0600, in a 0700 directory).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from memsafe import _jax, log, plan_store
from memsafe.compiling import add_trial, compile_measured
from memsafe.fused import policy
from memsafe.plan import PlanTime
from memsafe.program import Program
from memsafe.rules.registry import registered_rules
from memsafe.xla import hidden_constant_bytes, merged_options


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
    """The program stored under ``key``, compiled and verified to fit ``memory_limit`` again, or
    None (nothing stored, an entry that does not load, or a program that no longer fits)."""
    entry = plan_store.load(key)
    if entry is None:
        return None
    try:
        stored = pickle.loads(entry.payload)
        exported = jax.export.deserialize(stored["exported"])
        plan, options, hidden = stored["plan"], stored["options"], stored["hidden"]
        fun = exported.call
        what = (name, "stored program", memory_limit)
        got = compile_measured(fun, avals, options, donate, hidden, what)
        closed, _ = _jax.make_closed_jaxpr(fun, avals)
    except Exception as err:  # another jax's export, a payload that does not unpickle
        log.note(logging.WARNING, "%s: a stored plan did not load (%s); planning", name, err)
        return None
    if got.footprint.total > memory_limit:
        log.note(logging.WARNING, "%s: the stored plan no longer fits; planning", name)
        return None
    plan.time = PlanTime(compiles=[("stored program", got.seconds)])
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


def save(key: str, program: Program, name: str) -> None:
    """Store ``program`` (verified) under ``key``; a program ``jax.export`` cannot serialize
    (a host callback, say) is not stored."""
    try:
        exported = jax.export.export(program.jitted)(*program.avals)
        payload = {
            "exported": exported.serialize(),
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
