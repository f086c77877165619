"""What a pass is: a module of :mod:`memsafe.passes` with ``run(closed, ctx) -> closed``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from memsafe._jax import ClosedJaxpr
from memsafe.context import PassContext


class Pass(Protocol):
    """A rewriting pass: a module of :mod:`memsafe.passes` (or any object with these two
    attributes). It is recorded and reported under its name, the last component of
    ``__name__`` (:func:`memsafe.passes.pass_name`); no pass imports another.

    A pass whose result depends only on its program (not on the context's limit, budget, chunk
    scale or roll setting; it only records) may say so with a module attribute
    ``SCALE_FREE = True``: the leading such passes of the pipeline run once per search, their
    program and records shared by every attempt (:func:`memsafe.passes.scale_free_lead`); one
    later in the pipeline runs once per program it is given in a search (an attempt whose
    earlier passes made the same program object takes its program and records again).
    """

    __name__: str

    def run(self, closed: ClosedJaxpr, ctx: PassContext, /) -> ClosedJaxpr:
        """``closed`` rewritten into an equivalent program (or ``closed`` itself).

        Args:
            closed: the program, calls inlined.
            ctx: the limit and budget; the pass records what it did with ``ctx.record`` and
                what stopped it with ``ctx.block``.

        Returns:
            The rewritten program; a pass that cannot handle a program raises.
        """
        ...


#: A pass's ``run``: the program and the context to the rewritten program.
Rewrite = Callable[[ClosedJaxpr, PassContext], ClosedJaxpr]
