"""The rewriting pipeline, in order: match-and-replace, reorder, unflatten, hoist, distribute,
roll, remat, fission, split, schedule, recompute, constants. Each pass is a module with
``run(closed, ctx) -> closed``; its name is the module's. ``memsafe.lapack_order`` is applied
to every program memsafe compiles."""

from __future__ import annotations

from types import ModuleType

from memsafe.passes import (
    constants,
    distribute,
    fission,
    hoist,
    match_replace,
    recompute,
    remat,
    reorder,
    roll,
    schedule,
    split,
    unflatten,
)
from memsafe.passes.base import Pass, PassContext

#: Pass modules in the order the driver runs them.
PIPELINE: tuple[ModuleType, ...] = (
    match_replace,
    reorder,
    unflatten,
    hoist,
    distribute,
    roll,
    remat,
    fission,
    split,
    schedule,
    recompute,
    constants,
)


def pass_name(module: ModuleType) -> str:
    """The name a pass is recorded and reported under: its module's last component."""
    return module.__name__.rsplit(".", 1)[-1]


def named_passes() -> tuple[tuple[str, Pass], ...]:
    """The passes of :data:`PIPELINE` as (name, run) pairs, in order."""
    return tuple((pass_name(module), module.run) for module in PIPELINE)


__all__ = ["PIPELINE", "Pass", "PassContext", "named_passes", "pass_name"]
