"""How a memsafe program meets ``jax.vmap`` and an outer ``jax.jit``.

Under ``jax.vmap`` the program verified at the unbatched shapes would be batched by JAX as it
is: its chunks grow by the batch size and its footprint by about as much. A
:class:`BatchedProgram` is instead a ``jax.custom_batching.custom_vmap`` whose batching rule
re-plans the *original* function, vmapped, at the batched shapes under the same limit (and
compiles it with memsafe's own options); nested ``vmap`` re-plans again, one level at a time.
Where no rewrite of the batched program fits, the batch runs one element at a time
(``lax.map`` of the function, planned and verified under the limit as any program): its footprint
is the batched arguments and outputs and one element's temporaries, which fits wherever the
unbatched program's plan leaves room for the batch's arguments and outputs.

It is placed inside the ``custom_vjp`` of :mod:`memsafe.gradient` (in its primal, forward and
backward functions): a ``custom_vmap`` outside a ``custom_vjp`` cannot be differentiated.

Inside a staged trace (an outer ``jax.jit``, ``lax.scan``, ``jax.make_jaxpr``) the program is
inlined into the outer program, which the outer compile compiles with its own options: memsafe
says so once per function with :class:`OuterJitWarning`, except inside an outer ``memsafe.jit``
(see :func:`planning`), which plans, compiles and verifies the whole program itself.
"""

from __future__ import annotations

import contextvars
import functools
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

import jax
from jax.custom_batching import custom_vmap

from memsafe import _jax
from memsafe.errors import MemoryLimitError
from memsafe.limits import format_bytes
from memsafe.plan import PassRecord, Plan

F = TypeVar("F", bound=Callable[..., Any])

#: Set while memsafe itself traces and compiles a program: a memsafe function called in there
#: is part of a program memsafe plans and verifies as a whole, and needs no warning.
_PLANNING: contextvars.ContextVar[bool] = contextvars.ContextVar("memsafe_planning", default=False)


def planning(fun: F) -> F:
    """Decorate a function of memsafe's that traces and compiles user code under its own
    options and limit (``build_program``): memsafe functions it meets give no outer-jit warning."""

    @functools.wraps(fun)
    def run(*args: Any, **kwargs: Any) -> Any:
        token = _PLANNING.set(True)
        try:
            return fun(*args, **kwargs)
        finally:
            _PLANNING.reset(token)

    return run  # type: ignore[return-value]


class OuterJitWarning(UserWarning):
    """A memsafe function ran inside an outer ``jax.jit`` (or another staged trace)."""


class Runnable(Protocol):
    """What :class:`BatchedProgram` needs of a verified program (``memsafe.program.Program``)."""

    fun: Callable[..., Any]  # the rewritten program, traceable
    avals: tuple[jax.ShapeDtypeStruct, ...]

    def run(self, flat: Sequence[Any]) -> Any:
        """Run the verified executable on concrete arrays."""


#: Builds a verified program: (flat function, argument avals, name) -> program.
Builder = Callable[[Callable[..., Any], Sequence[jax.ShapeDtypeStruct], str], Runnable]


def outer_jit_message(name: str) -> str:
    """The warning given once per function called inside an outer ``jax.jit``."""
    return (
        f"memsafe: {name} is called inside an outer jax.jit (or lax.scan, jax.make_jaxpr, ...): "
        "its program is inlined into the outer program, which the outer compile compiles with "
        "its own XLA options (on the CPU, YNNPACK fusions on, whose buffers memory_analysis() "
        "does not count and which can change NaN into inf) and schedules as a whole, so "
        "memsafe cannot verify that footprint. Remedy: call the memsafe function outside "
        "jax.jit, or wrap the whole step in memsafe.jit."
    )


class BatchedProgram:
    """A verified program that, under ``jax.vmap``, runs a program re-planned at the batched
    shapes instead of the batched original.

    Args:
        source: the flat function ``program`` was built from (a list of arrays in, a list out).
        program: its verified program at ``program.avals``.
        build: builds the verified program of a vmapped ``source``.
        name: the function's name, for messages and plans.
        warned: a one-element list shared by every level of one memsafe function, set once the
            outer-jit warning was given.
    """

    def __init__(
        self,
        source: Callable[..., list[Any]],
        program: Runnable,
        build: Builder,
        name: str,
        warned: list[bool],
    ) -> None:
        self.source = source
        self.program = program
        self.build = build
        self.name = name
        self.warned = warned
        self._children: dict[tuple[int, tuple[bool, ...]], BatchedProgram] = {}
        self._call = custom_vmap(self._traced)
        self._call.def_vmap(self._vmap_rule)

    def __call__(self, *flat: Any) -> list[Any]:
        """Run on concrete arrays (the verified executable) or inside a trace (through
        ``custom_vmap``, so that a ``vmap`` around it re-plans)."""
        if not any(_jax.is_tracer(x) for x in flat):
            return list(self.program.run(flat))
        if not any(_jax.is_batch_tracer(x) for x in flat):
            self._warn_outer_jit()
        return list(self._call(*flat))

    def _traced(self, *flat: Any) -> list[Any]:
        return list(self.program.fun(*flat))

    def _vmap_rule(
        self, axis_size: int, in_batched: Sequence[bool], *flat: Any
    ) -> tuple[list[Any], list[bool]]:
        """custom_vmap's rule: batched arguments have their batch axis first."""
        child = self.batched(axis_size, tuple(bool(b) for b in in_batched))
        outs = child(*flat)
        return outs, [True] * len(outs)

    def batched(self, axis_size: int, in_batched: tuple[bool, ...]) -> BatchedProgram:
        """The program of ``vmap(source)`` over the arguments flagged in ``in_batched`` (batch
        axis first, the others unbatched), verified under the same limit; cached."""
        key = (axis_size, in_batched)
        child = self._children.get(key)
        if child is None:
            in_axes = tuple(0 if b else None for b in in_batched)
            source = jax.vmap(self.source, in_axes=in_axes, axis_size=axis_size)
            avals = [
                _with_batch_axis(a, axis_size) if b else a
                for a, b in zip(self.program.avals, in_batched)
            ]
            name = f"{self.name} under vmap (batch {axis_size})"
            try:
                program = self.build(source, avals, name)
            except MemoryLimitError as batched_error:
                one_at_a_time = _one_at_a_time(self.source, in_batched)
                try:
                    program = self.build(one_at_a_time, avals, f"{name}, one at a time")
                except MemoryLimitError:
                    raise batched_error from None
                _record_one_at_a_time(program.plan, axis_size, batched_error)
            child = BatchedProgram(source, program, self.build, self.name, self.warned)
            self._children[key] = child
        return child

    def _warn_outer_jit(self) -> None:
        if self.warned[0] or _PLANNING.get():
            return
        self.warned[0] = True
        warnings.warn(outer_jit_message(self.name), OuterJitWarning, stacklevel=_user_level())


def _user_level() -> int:
    """The ``stacklevel`` of the first frame outside memsafe and JAX (the user's call), so the
    warning names the user's line."""
    skip = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, jax.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _one_at_a_time(
    source: Callable[..., list[Any]], in_batched: tuple[bool, ...]
) -> Callable[..., list[Any]]:
    """``vmap(source)`` as a sequential ``lax.map`` over the batch axis (first) of the arguments
    flagged in ``in_batched``; every output gets the batch axis first, as under ``vmap``."""

    def run(*flat: Any) -> list[Any]:
        def one(batched: list[Any]) -> list[Any]:
            rows = iter(batched)
            return list(source(*(next(rows) if b else x for x, b in zip(flat, in_batched))))

        return jax.lax.map(one, [x for x, b in zip(flat, in_batched) if b])

    return run


def _record_one_at_a_time(plan: Plan, axis_size: int, batched_error: MemoryLimitError) -> None:
    """Say in ``plan`` that the batch runs one element at a time, and why."""
    best = batched_error.footprint
    reached = f" (best footprint reached {format_bytes(best)})" if best is not None else ""
    plan.fits_unchanged = False
    plan.records.insert(
        0,
        PassRecord(
            "one at a time",
            f"no rewrite of the batched program fits{reached}: the batch of {axis_size} runs "
            "as a lax.map of the function, one element after another",
        ),
    )


def _with_batch_axis(aval: jax.ShapeDtypeStruct, size: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        (size, *aval.shape), aval.dtype, weak_type=getattr(aval, "weak_type", False)
    )
