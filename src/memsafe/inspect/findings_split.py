"""The finding that points to ``memsafe.jit``: a large temporary that can be computed in chunks.

A temporary is splittable here when one of its axes (not the minor one, which kernels reduce
over) has the extent of an axis of a parameter: the computation can then run over slices of that
parameter one after another, which is what ``memsafe.jit`` does, verifying the footprint. When the
report holds ``memsafe.jit``'s plan (``memsafe.inspect(..., memory_limit=...)``), the finding
quotes the split the plan made.
"""

from __future__ import annotations

from collections.abc import Iterable

from memsafe import policy
from memsafe.inspect.findings import register_finding
from memsafe.inspect.model import Array, Finding
from memsafe.inspect.view import ReportView
from memsafe.limits import format_bytes
from memsafe.sources import shorten_paths


def split_axis(report: ReportView, array: Array) -> tuple[int, Array] | None:
    """The axis of ``array`` to chunk along and the parameter that has it, or None.

    Among the array's axes but its minor one (with a single axis, that one), the longest whose
    extent is also an extent of a parameter's axis.
    """
    dims = array.shape
    candidates = range(len(dims) - 1) if len(dims) > 1 else range(len(dims))
    params = [a for a in report.arrays if a.role == "parameter"]
    best: tuple[int, Array] | None = None
    for axis in candidates:
        extent = dims[axis]
        if extent < 2 or (best is not None and extent <= dims[best[0]]):
            continue
        owner = next((p for p in params if extent in p.shape), None)
        if owner is not None:
            best = (axis, owner)
    return best


def _plan_note(report: ReportView) -> str:
    if report.plan is None or not report.plan.splits:
        return ""
    limit = format_bytes(report.plan.memory_limit)
    return f" At memory_limit={limit} it did: {shorten_paths(report.plan.splits[0].describe())}."


def _candidates(report: ReportView) -> dict[tuple[int, str], list[Array]]:
    """Large top-level temporaries, grouped by the extent and parameter they would split along."""
    total = max(report.footprint.total, 1)
    groups: dict[tuple[int, str], list[Array]] = {}
    for array in report.temporaries:
        if (
            array.bytes < policy.INSPECT.split_min_bytes
            or array.bytes < policy.INSPECT.split_min_fraction * total
        ):
            continue
        if array.role != "temporary" or array.parent is not None:
            continue  # a loop's state or a value inside a loop body is already per iteration
        found = split_axis(report, array)
        if found is not None:
            axis, owner = found
            groups.setdefault((array.shape[axis], owner.name), []).append(array)
    return groups


@register_finding("splittable_temporary")
def splittable_temporary(report: ReportView) -> Iterable[Finding]:
    """Large temporaries that ``memsafe.jit`` can compute in sequential chunks along an axis.

    One finding per axis they share (the attention scores, their exponentials and products are
    one finding); its bytes are the largest temporary's.
    """
    total = max(report.footprint.total, 1)
    for (extent, owner_name), arrays in _candidates(report).items():
        owner = report.graph.arrays[owner_name]
        first = arrays[0]
        listed = ", ".join(a.describe() for a in arrays)
        share = 100 * first.bytes / total
        yield Finding(
            rule="splittable_temporary",
            bytes=first.bytes,
            message=(
                f"{len(arrays)} large temporar{'y' if len(arrays) == 1 else 'ies'} ({listed};"
                f" the largest {share:.0f}% of the footprint) have an axis of size {extent},"
                f" an axis of parameter {owner.name} {owner.type}: they can be computed in"
                " sequential chunks along it."
            ),
            advice=(
                "memsafe.jit(f, memory_limit=...) runs them chunk by chunk and verifies the"
                " footprint against the limit; memsafe.inspect(f, *args, memory_limit=...) shows"
                " its plan and memory timeline beside this one." + _plan_note(report)
            ),
            where=report.graph.kernels[first.producer].where if first.producer else "",
            kernels=tuple(a.producer for a in arrays if a.producer),
            arrays=tuple(a.name for a in arrays),
            fixed_by_memsafe_jit=True,
        )
