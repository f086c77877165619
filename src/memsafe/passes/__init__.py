"""The rewriting pipeline, in order: match-and-replace, reorder, split, schedule, recompute,
constants. Each pass is a module with ``run(closed, ctx) -> closed``."""

from __future__ import annotations

import importlib

from memsafe.passes.base import Pass, PassContext

#: Pass modules in the order the driver runs them.
PIPELINE: tuple[str, ...] = (
    "match_replace",
    "reorder",
    "split",
    "schedule",
    "recompute",
    "constants",
)


def load_pipeline() -> list[tuple[str, Pass]]:
    """The passes of :data:`PIPELINE` that are present, as (name, run) pairs."""
    passes: list[tuple[str, Pass]] = []
    for name in PIPELINE:
        try:
            module = importlib.import_module(f"memsafe.passes.{name}")
        except ModuleNotFoundError as err:
            if err.name == f"memsafe.passes.{name}":
                continue
            raise
        passes.append((name, module.run))
    return passes


__all__ = ["PIPELINE", "Pass", "PassContext", "load_pipeline"]
