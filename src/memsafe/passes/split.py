"""The splitting pass: regions around too-large values run in sequential chunks, at the top level
and inside the programs loops run; values no axis can split are reported as blockers. The planning
is :mod:`memsafe.split.planner` (which value, which axis, which strategy and chunk), run over the
whole program by :mod:`memsafe.split.program`."""

from __future__ import annotations

from memsafe._jax import ClosedJaxpr
from memsafe.context import PassContext
from memsafe.split.program import split_program


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Split every too-large intermediate that some axis allows; block the rest."""
    return split_program(closed, ctx)
