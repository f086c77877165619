"""The rewriting passes and the pipelines that run them, declared here once.

Each pass is a module with ``run(closed, ctx) -> closed`` (:class:`Pass`); its name is the
module's. No pass imports another: what several share lives outside ``passes/``
(:mod:`memsafe.rewrite`, :mod:`memsafe.graph`, :mod:`memsafe.split`, :mod:`memsafe.context`).
``memsafe.lapack_order`` is applied to every program memsafe compiles.
"""

from __future__ import annotations

from collections.abc import Sequence

from memsafe.passes import (
    constants,
    distribute,
    fission,
    fold,
    hoist,
    inplace,
    match_replace,
    recompute,
    remat,
    reorder,
    roll,
    schedule,
    split,
    tie,
    trips,
    unflatten,
)
from memsafe.passes.base import Pass, Rewrite

#: The full pipeline: every pass, in the order the driver runs them on a program to fit a limit.
PIPELINE: tuple[Pass, ...] = (
    fold,
    match_replace,
    reorder,
    unflatten,
    inplace,
    hoist,
    distribute,
    roll,
    remat,
    fission,
    trips,
    split,
    schedule,
    recompute,
    constants,
    tie,
)

#: The algebraic pipeline: the passes that rewrite the algebra alone, whatever the limit (run on
#: the forward a gradient differentiates, custom derivative rules kept).
ALGEBRAIC: tuple[Pass, ...] = (match_replace, reorder)

#: Passes the driver plans the program without again (``PassContext.roll`` false) where no
#: attempt with them fits and they rewrote something: a scan they make can stop a split the
#: program as written allows (a ResNet's batch-norm gradient).
RETRIED_WITHOUT: tuple[Pass, ...] = (roll,)


def pass_name(module: Pass) -> str:
    """The name a pass is recorded and reported under: its module's last component."""
    return module.__name__.rsplit(".", 1)[-1]


def named_passes(pipeline: Sequence[Pass] | None = None) -> tuple[tuple[str, Rewrite], ...]:
    """The passes of a pipeline as (name, run) pairs, in order.

    Args:
        pipeline: :data:`ALGEBRAIC`, :data:`RETRIED_WITHOUT` or another sequence of passes;
            :data:`PIPELINE` (as it is when called) by default.

    Returns:
        Each pass's :func:`pass_name` and ``run``.
    """
    chosen = PIPELINE if pipeline is None else pipeline
    return tuple((pass_name(module), module.run) for module in chosen)


def scale_free_lead(pipeline: Sequence[Pass] | None = None) -> int:
    """How many passes at the head of a pipeline declare ``SCALE_FREE`` (see :class:`Pass`):
    the driver runs them once per search, not once per attempt.

    Args:
        pipeline: :data:`PIPELINE` (as it is when called) by default.

    Returns:
        The number of leading passes whose result does not depend on the attempt.
    """
    chosen = PIPELINE if pipeline is None else pipeline
    lead = 0
    for module in chosen:
        if not getattr(module, "SCALE_FREE", False):
            break
        lead += 1
    return lead


def scale_free_names(pipeline: Sequence[Pass] | None = None) -> frozenset[str]:
    """The names of the passes of a pipeline that declare ``SCALE_FREE``, wherever they are:
    the driver runs one after the lead once per program it is given in a search.

    Args:
        pipeline: :data:`PIPELINE` (as it is when called) by default.

    Returns:
        Their names (:func:`pass_name`).
    """
    chosen = PIPELINE if pipeline is None else pipeline
    return frozenset(pass_name(m) for m in chosen if getattr(m, "SCALE_FREE", False))


def inserted(new: Pass, *, before: str, pipeline: Sequence[Pass] | None = None) -> tuple[Pass, ...]:
    """A pipeline with one more pass: how a pass from outside memsafe joins the driver's.

    The driver reads :data:`PIPELINE` each time it plans a program, so a library adds its pass
    with ``memsafe.passes.PIPELINE = memsafe.passes.inserted(my_pass, before="split")``.

    Args:
        new: the pass (a module, or any object with ``__name__`` and ``run``: :class:`Pass`).
        before: the name (:func:`pass_name`) of the pass it runs just before.
        pipeline: the pipeline it joins; :data:`PIPELINE` (as it is when called) by default.

    Returns:
        ``pipeline`` with ``new`` before the pass named ``before``.

    Raises:
        ValueError: no pass of ``pipeline`` is named ``before``.
    """
    chosen = tuple(PIPELINE if pipeline is None else pipeline)
    names = [pass_name(p) for p in chosen]
    if before not in names:
        raise ValueError(f"no pass named {before!r} in the pipeline: {names}")
    at = names.index(before)
    return (*chosen[:at], new, *chosen[at:])


__all__ = [
    "ALGEBRAIC",
    "PIPELINE",
    "RETRIED_WITHOUT",
    "Pass",
    "Rewrite",
    "inserted",
    "named_passes",
    "pass_name",
    "scale_free_lead",
    "scale_free_names",
]
