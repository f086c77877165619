"""The fast path of a memsafe function's call: a program already verified, run at once.

A call's arguments are flattened once (JAX's C++ pytree flattening) and the program is looked up
by their tree structure alone; the executable checks the shapes and dtypes itself (it raises
``TypeError`` on a mismatch) and this module checks what it does not: that every leaf is a
concrete array (a JAX array, never a tracer, or a NumPy array) with the weak type the program was
planned for. Anything else (static arguments, Python scalars, tracers, a new shape) takes the
slow path, which plans where needed and tells the fast path what it ran (:meth:`remember`).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import numpy as np

from memsafe._jax import ConcreteArray

#: What :meth:`FastPath.call` returns when the call must take the slow path.
MISS = object()

_flatten = jax.tree_util.tree_flatten
_unflatten = jax.tree_util.tree_unflatten


class Executable(Protocol):
    """What the fast path needs of a verified program (``memsafe.program.Program``)."""

    executable: Any
    out_tree: Any


class FastPath:
    """Verified programs of one memsafe function without static arguments, keyed by the tree
    structure of ``(args, kwargs)``: the latest program run for each structure."""

    def __init__(self) -> None:
        self._entries: dict[Any, tuple[Executable, tuple[bool, ...]]] = {}

    def call(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The outputs of the remembered program on these arguments, or :data:`MISS`."""
        leaves, tree = _flatten((args, kwargs))
        entry = self._entries.get(tree)
        if entry is None:
            return MISS
        program, weak = entry
        for x, w in zip(leaves, weak):
            kind = type(x)
            if kind is ConcreteArray:
                if x.weak_type is not w:
                    return MISS
            elif kind is not np.ndarray or w:
                return MISS
        try:
            outs = program.executable(*leaves)
        except (TypeError, ValueError):  # another shape or dtype, or an array elsewhere
            return MISS
        return _unflatten(program.out_tree, outs)

    def remember(self, args: tuple, kwargs: dict[str, Any], program: Executable) -> None:
        """Let calls structured as ``(args, kwargs)`` run ``program`` directly, when every leaf
        is a concrete array and the program has an executable."""
        if program.executable is None:
            return
        leaves, tree = _flatten((args, kwargs))
        weak = []
        for x in leaves:
            if type(x) is ConcreteArray:
                weak.append(bool(x.weak_type))
            elif type(x) is np.ndarray:
                weak.append(False)
            else:
                return
        self._entries[tree] = (program, tuple(weak))
