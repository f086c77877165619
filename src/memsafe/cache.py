"""Verified programs shared across memsafe functions.

A second ``memsafe.jit(f, memory_limit=...)`` of a function already planned, or another
function that traces to the same program, reuses the verified program (its plan and its compiled
executable) instead of rewriting and compiling again.

The key is the traced program, not the Python function: the text of its jaxpr (every equation,
parameter and literal), the identity of its closed-over JAX arrays (immutable; the entry keeps
them alive, so an identity is never reused while the entry lives), a digest of the contents of
its closed-over NumPy arrays (mutable in place), the argument shapes, dtypes and weak types, and
the settings that shape a plan (limit, donated arguments, compiler options, registered rules,
backend, the program a rewrite starts from). So a closure whose captured arrays differ, a global
rebound, a static argument or Python scalar baked in differently all trace to another key: a
stale program is never returned. Tracing costs little next to compiling; what the cache saves is
the rewriting and the XLA compiles.

The cache holds the :data:`MAX_ENTRIES` most recently used programs; :func:`clear` empties it.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

#: How many verified programs the cache keeps (least recently used dropped first).
MAX_ENTRIES = 64


@dataclass(frozen=True)
class ProgramKey:
    """What a verified program depends on (see the module docstring)."""

    text: str
    consts: tuple[Hashable, ...]
    avals: tuple[tuple[tuple[int, ...], str, bool], ...]
    settings: tuple[Hashable, ...]


def _const_key(value: Any) -> Hashable:
    """A JAX array by identity; anything else (NumPy arrays, which can change in place) by its
    shape, dtype and a digest of its bytes."""
    if isinstance(value, jax.Array):
        return ("id", id(value))
    array = np.asarray(value)
    digest = hashlib.blake2b(np.ascontiguousarray(array).tobytes(), digest_size=16).hexdigest()
    return ("bytes", array.shape, str(array.dtype), digest)


#: Texts of jaxprs printed already (a jaxpr is immutable): the program key and the plan store's
#: digest both read the text of the program just traced, which printing twice would cost twice
#: (0.05 s for a training step's jaxpr).
_TEXTS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _text(closed: Any) -> str:
    """The jaxpr's text, with NumPy printing every element of any array it shows."""
    jaxpr = closed.jaxpr
    text = _TEXTS.get(jaxpr)
    if text is None:
        with np.printoptions(threshold=sys.maxsize):
            text = _TEXTS[jaxpr] = str(jaxpr)
    return text


def program_key(
    closed: Any, avals: Sequence[jax.ShapeDtypeStruct], settings: tuple[Hashable, ...]
) -> ProgramKey:
    """The key of ``closed`` (a ClosedJaxpr traced at ``avals``) under ``settings``.

    Args:
        closed: the traced program.
        avals: its flat arguments' shapes and dtypes.
        settings: hashable values the plan depends on besides the program.

    Returns:
        The :class:`ProgramKey`.
    """
    shapes = tuple(
        (tuple(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False))) for a in avals
    )
    consts = tuple(_const_key(c) for c in closed.consts)
    return ProgramKey(_text(closed), consts, shapes, settings)


@dataclass
class _Entry:
    program: Any
    keep: tuple[Any, ...]  # what the key's identities refer to, kept alive


class ProgramCache:
    """A bounded, thread-safe map from :class:`ProgramKey` to verified programs.

    Programs are dataclasses with a ``plan`` (``memsafe.program.Program``); each lookup returns a
    copy with its own plan, so that what one function records on its program (its output tree,
    its backward plan) does not reach another's.
    """

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[ProgramKey, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: ProgramKey) -> Any | None:
        """A copy of the program stored under ``key``, or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
        return fresh(entry.program)

    def put(self, key: ProgramKey, program: Any, keep: tuple[Any, ...]) -> None:
        """Store a copy of ``program`` under ``key``, keeping ``keep`` (the traced programs the
        key was made from) alive with it."""
        with self._lock:
            self._entries[key] = _Entry(fresh(program), keep)
            self._entries.move_to_end(key)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def clear(self) -> None:
        """Forget every program."""
        with self._lock:
            self._entries.clear()
            self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)


def fresh(program: Any) -> Any:
    """A shallow copy of ``program`` with its own plan (records and attempts lists copied)."""
    plan = copy.copy(program.plan)  # (not dataclasses.replace: it would read a lazy ``before``)
    plan.records, plan.attempts = list(plan.records), list(plan.attempts)
    return dataclasses.replace(program, plan=plan)


#: The cache every memsafe function uses.
PROGRAMS = ProgramCache()


def clear() -> None:
    """Forget every verified program memsafe keeps across functions (``memsafe.clear_cache``)."""
    PROGRAMS.clear()
