"""A verified program: what one memsafe function runs for one set of argument shapes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax

from memsafe import _jax, tuning
from memsafe.plan import Plan
from memsafe.split.strategies.sharded import mesh


@dataclass(frozen=True)
class Program:
    """A program verified to fit its limit, built once.

    Attributes:
        jitted: the ``jax.jit``-wrapped function of the flat dynamic arguments.
        fun: the same, unjitted: what runs inside an outer trace (``jit``, ``grad``, ``vmap``).
        avals: the flat arguments' shapes and dtypes (placed on a mesh where one is used).
        out_tree: the outputs' tree structure.
        plan: what was done (:class:`memsafe.Plan`).
        closed: the program that runs (the original when it fits unchanged).
        compiled: the verified executable, called directly to avoid a second compile.
        source: the flat function planned, where it differs from the user's (a backward).
        on_mesh: the mesh it runs on (limit per device), if any.
        trial: compile options being timed over the first calls (:mod:`memsafe.tuning`).
        options: the compiler options it was compiled with (memsafe's merged in when compiled).
        origin: how it was obtained: "planned" (a search), "reused" (verified before in this
            process, :mod:`memsafe.cache`), "loaded" (from the plan store, :mod:`memsafe.stored`).
    """

    jitted: Any
    fun: Callable[..., Any]
    avals: tuple[jax.ShapeDtypeStruct, ...]
    out_tree: Any
    plan: Plan
    closed: _jax.ClosedJaxpr
    compiled: Any = None
    source: Any = None
    on_mesh: mesh.MeshPlan | None = None
    trial: tuning.Trial | None = None
    options: Mapping[str, Any] | None = None
    origin: str = "planned"

    @property
    def settled(self) -> bool:
        """Whether every call runs :attr:`executable` (no trial of compile options under way)."""
        return self.trial is None or self.trial.settled

    @property
    def executable(self) -> Any:
        """The executable calls run once settled: the trial's choice, else :attr:`compiled`."""
        if self.trial is not None and self.trial.settled:
            return self.trial.chosen
        return self.compiled

    def run(self, flat: Sequence[Any]) -> Any:
        """Run on concrete arrays: the verified executable, or jit's path for odd argument types.
        On a mesh the arguments are first placed as the program was compiled for."""
        if any(getattr(a, "sharding", None) is not None for a in self.avals):
            flat = mesh.place(flat, self.avals)
        if self.compiled is not None:
            try:
                return self.executable(*flat) if self.settled else self.trial.run(flat)
            except (TypeError, ValueError):
                pass  # e.g. Python scalars or arrays on another device: let jit convert them
        return self.jitted(*flat)
