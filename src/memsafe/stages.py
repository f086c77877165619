"""Ahead-of-time stages of a memsafe function, as ``jax.jit``'s: ``f.trace(*args)`` gives a
:class:`Traced`, ``.lower()`` a :class:`Lowered`, ``.compile()`` a :class:`Compiled` that is called
with the same pytrees as the function (static arguments left out, as in JAX, or repeated).

Unlike JAX's, every stage holds a program already verified under the limit: tracing a memsafe
function plans it (rewrites, compiles, measures), and ``compile()`` returns the executable that was
measured rather than compiling again. Other attributes (``as_text``, ``cost_analysis``,
``memory_analysis``, ...) are those of the underlying ``jax.stages`` objects.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import jax

from memsafe.arguments import ArgSpec, Call
from memsafe.plan import Plan


class VerifiedProgram(Protocol):
    """What the stages need of a verified program (``memsafe.program.Program``)."""

    jitted: Any
    executable: Any
    avals: tuple[jax.ShapeDtypeStruct, ...]
    out_tree: Any
    plan: Plan
    closed: Any

    def call(self, flat: list[Any]) -> Any: ...


def _shapes(avals: tuple[jax.ShapeDtypeStruct, ...]) -> str:
    return ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals) or "no arrays"


class _Stage:
    """What all stages share: the function's argument spec, the call they were made for, the
    verified program and its plan."""

    def __init__(self, spec: ArgSpec, call: Call, program: VerifiedProgram) -> None:
        self._spec = spec
        self._call = dataclasses.replace(call, flat=[])  # keep no arrays alive
        self._program = program

    @property
    def plan(self) -> Plan:
        """What memsafe did to the program (see :class:`memsafe.Plan`)."""
        return self._program.plan

    @property
    def fun_name(self) -> str:
        return getattr(self._spec.fun, "__name__", repr(self._spec.fun))

    @property
    def in_avals(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The flat dynamic arguments' shapes and dtypes."""
        return self._program.avals

    @property
    def out_info(self) -> Any:
        """The outputs' shapes and dtypes, in the function's output pytree."""
        outs = [
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
            for v in self._program.closed.jaxpr.outvars
        ]
        return jax.tree_util.tree_unflatten(self._program.out_tree, outs)


class Compiled(_Stage):
    """The verified executable; call it with the arguments the function takes."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the executable on ``args`` (pytrees as at lowering; static arguments may be left
        out, as JAX's compiled functions expect, or given with their lowered values).

        Raises:
            TypeError: arguments whose structure, shapes, dtypes or static values differ from
                those the program was lowered for.
        """
        args, kwargs = self._with_statics(args, kwargs)
        call = self._spec.split(args, kwargs)
        if call.key != self._call.key:
            raise TypeError(
                f"memsafe: {self.fun_name} was compiled for arguments ({_shapes(self.in_avals)}) "
                f"and is called with ({_shapes(call.avals)}), a different structure, shape, dtype "
                "or static value; lower it again for these arguments, or call the memsafe "
                "function itself, which plans each new set of arguments"
            )
        outs = self._program.run(call.flat)
        return jax.tree_util.tree_unflatten(self._program.out_tree, list(outs))

    def _with_statics(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``args`` and ``kwargs`` with the lowered static values put back where left out."""
        static_args, static_kwargs = self._call.static_args, self._call.static_kwargs
        kwargs = {**dict(k for k in static_kwargs if k[0] not in kwargs), **kwargs}
        if len(args) + len(static_args) != self._call.n_args:
            return args, kwargs  # given in full, or wrong: split() and the key check tell
        full, it = [], iter(args)
        statics = dict(static_args)
        for i in range(self._call.n_args):
            full.append(statics[i] if i in statics else next(it))
        return tuple(full), kwargs

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # not JAX's: no recursion while half-built (copy, pickle)
            raise AttributeError(name)
        return getattr(self._program.executable, name)

    def __repr__(self) -> str:
        return f"memsafe.stages.Compiled({self.fun_name}, {_shapes(self.in_avals)})"


class Lowered(_Stage):
    """The verified program lowered for its arguments; ``compile()`` gives the executable that
    memsafe measured."""

    def compile(self) -> Compiled:
        """The verified executable (no second compile)."""
        return Compiled(self._spec, self._call, self._program)

    @property
    def lowered(self) -> jax.stages.Lowered:
        """JAX's own ``Lowered`` of the program, called with the flat dynamic arguments."""
        return self._program.jitted.lower(*self._program.avals)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.lowered, name)

    def __repr__(self) -> str:
        return f"memsafe.stages.Lowered({self.fun_name}, {_shapes(self.in_avals)})"


class Traced(_Stage):
    """The function traced and planned for its arguments."""

    @property
    def jaxpr(self) -> Any:
        """The ``ClosedJaxpr`` that runs: the rewritten program, or the original one when it
        fits unchanged."""
        return self._program.closed

    def lower(self) -> Lowered:
        return Lowered(self._spec, self._call, self._program)

    def __repr__(self) -> str:
        return f"memsafe.stages.Traced({self.fun_name}, {_shapes(self.in_avals)})"
