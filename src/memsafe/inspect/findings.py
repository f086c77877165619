"""Findings: seed 002's rules of thumb, each a plain function over the compiled kernel graph.

A finding check takes a report (anything with the fields of
:class:`~memsafe.inspect.view.ReportView`) and returns :class:`Finding` objects with the bytes the
pattern costs, measured from HLO shapes. Checks are registered in ``FINDINGS`` by name;
``register_finding`` adds a user's own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

from memsafe import policy
from memsafe.inspect.model import Array, Finding, Kernel
from memsafe.inspect.view import ReportView
from memsafe.limits import format_bytes

#: A finding check: what one rule of thumb finds in a report.
FindingCheck = Callable[[ReportView], Iterable[Finding]]

#: Kernels whose work is heavy (not worth recomputing, and what parallel branches are made of).
HEAVY_OPS = frozenset({"dot", "fft", "convolution", "custom-call", "sort", "triangular-solve"})
#: Ops cheap enough to recompute inside a consumer kernel.
CHEAP_OPS = frozenset(
    {
        "parameter",
        "constant",
        "iota",
        "broadcast",
        "bitcast",
        "reshape",
        "convert",
        "add",
        "subtract",
        "multiply",
        "divide",
        "negate",
        "abs",
        "power",
        "exponential",
        "log",
        "sine",
        "cosine",
        "tanh",
        "sqrt",
        "rsqrt",
        "maximum",
        "minimum",
        "select",
        "compare",
        "and",
        "or",
        "not",
        "xor",
        "concatenate",
        "slice",
        "floor",
        "ceil",
        "round-nearest-even",
        "sign",
        "clamp",
        "shift-left",
        "shift-right-logical",
        "real",
        "imag",
        "complex",
        "exponential-minus-one",
        "log-plus-one",
        "logistic",
        "remainder",
    }
)
#: Ops of a kernel that only fills memory with a broadcast value.
FILL_OPS = frozenset({"parameter", "constant", "broadcast", "bitcast", "reshape", "copy"})
#: Ops that move data into another layout.
TRANSPOSE_OPS = frozenset({"transpose", "copy"})

#: The finding checks ``memsafe.inspect`` runs, by the name their findings carry.
FINDINGS: dict[str, FindingCheck] = {}


def register_finding(name: str) -> Callable[[FindingCheck], FindingCheck]:
    """Register a finding check under ``name`` (a decorator)."""

    def add(check: FindingCheck) -> FindingCheck:
        FINDINGS[name] = check
        return check

    return add


def find_all(report: ReportView) -> list[Finding]:
    """Every registered check's findings, largest cost first."""
    found: list[Finding] = []
    for check in FINDINGS.values():
        found.extend(check(report))
    return sorted(found, key=lambda f: -f.bytes)


# -- helpers ------------------------------------------------------------------------------------


def _ops(report: ReportView, kernel: Kernel) -> set[str]:
    return {i.opcode for i in report.graph.fused(kernel.name)}


def _is_heavy(report: ReportView, kernel: Kernel) -> bool:
    return bool(_ops(report, kernel) & HEAVY_OPS)


def _is_cheap(report: ReportView, kernel: Kernel) -> bool:
    return kernel.opcode in ("fusion", *CHEAP_OPS) and _ops(report, kernel) <= CHEAP_OPS


def _reduced_extent(report: ReportView, kernel: Kernel) -> int | None:
    """Elements each output of a reduction kernel sums over (None if it reduces nothing)."""
    graph = report.graph
    extent = None
    for inst in graph.fused(kernel.name):
        if inst.opcode != "reduce" or not inst.operands:
            continue
        operand = graph.instructions.get(inst.operands[0])
        if operand is None or operand.shape.is_tuple:
            continue
        dims = inst.int_list("dimensions")
        size = math.prod(operand.shape.dims[d] for d in dims if d < len(operand.shape.dims))
        extent = size if extent is None else max(extent, size)
    return extent


def _array_inputs(report: ReportView, kernel: Kernel) -> list[Array]:
    return [report.graph.arrays[a] for a in kernel.inputs]


def _generated(report: ReportView, array: Array) -> bool:
    """The array is computed by cheap kernels from iota and constants only (no inputs)."""
    graph = report.graph
    if array.producer is None:
        return False
    kernels = {array.producer} | graph.ancestors(array.producer)
    for name in kernels:
        k = graph.kernels[name]
        if not _is_cheap(report, k):
            return False
        for a in k.inputs:
            arr = graph.arrays[a]
            if arr.role in ("parameter", "loop state") and arr.producer not in kernels:
                return False
    return True


def _initializes_loop(report: ReportView, array: Array) -> bool:
    """The array only starts loop state that the loop overwrites (``jnp.zeros_like`` carries)."""
    if not array.consumers:
        return False
    for consumer in array.consumers:
        loop = report.graph.loops.get(consumer)
        if loop is None:
            return False
        if any(array.name in s.init and s.invariant for s in loop.state):
            return False
    return True


def _where(report: ReportView, kernel_name: str | None) -> str:
    if kernel_name is None:
        return ""
    return report.graph.kernels[kernel_name].where


# -- rules --------------------------------------------------------------------------------------


@register_finding("reduction_barrier")
def reduction_barrier(report: ReportView) -> Iterable[Finding]:
    """A short reduction in its own kernel, whose consumer also reads the reduction's input.

    Seed 002's f_sum_jax: ``x * 2 + jnp.sum(kvm * x, axis=1)`` over an axis of 2 becomes a reduce
    kernel and an add kernel with the sum between them; written as ``kvm[..., 0] * x[..., 0] +
    kvm[..., 1] * x[..., 1]`` it fuses into one kernel.
    """
    graph = report.graph
    for kernel in report.kernels:
        extent = _reduced_extent(report, kernel)
        if extent is None or extent > policy.INSPECT.small_axis:
            continue
        reads = set(kernel.inputs)
        for out in kernel.outputs:
            array = graph.arrays[out]
            if array.bytes < policy.INSPECT.min_bytes or array.role not in (
                "temporary",
                "loop state",
            ):
                continue
            for consumer in array.consumers:
                shared = (reads & set(graph.kernels[consumer].inputs)) - {out}
                if not shared or graph.kernels[consumer].opcode != "fusion":
                    continue
                yield Finding(
                    rule="reduction_barrier",
                    bytes=array.bytes,
                    message=(
                        f"{kernel.name} reduces over {extent} elements in its own kernel and"
                        f" writes {array.describe()}, which {consumer} reads together with"
                        f" {', '.join(sorted(shared))}, the reduction's own input."
                    ),
                    advice=(
                        f"XLA does not fuse a reduction into a consumer that also reads its"
                        f" input; write the {extent}-term sum out explicitly (a[..., 0] * b[..., 0]"
                        f" + a[..., 1] * b[..., 1] + ...) so both fuse into one kernel and the"
                        f" {format_bytes(array.bytes)} temporary disappears."
                    ),
                    where=kernel.where,
                    kernels=(kernel.name, consumer),
                    arrays=(out,),
                    fixed_by_memsafe_jit=False,
                )
                break


@register_finding("large_constant")
def large_constant(report: ReportView) -> Iterable[Finding]:
    """Constants folded into the executable or passed as hidden arguments (seed 002's f_numpy)."""
    for c in report.constants:
        if c.bytes < policy.INSPECT.min_bytes:
            continue
        origin = "a closed-over array" if c.closed_over else "a constant"
        if c.kind == "folded":
            seen = f"{origin} {c.type} ({format_bytes(c.bytes)}) is folded into the executable"
        else:
            seen = f"{origin} {c.type} ({format_bytes(c.bytes)}) is passed as a hidden argument"
        counted = (
            "memory_analysis() counts it as generated code."
            if c.counted
            else "memory_analysis() does not count it."
        )
        yield Finding(
            rule="large_constant",
            bytes=c.bytes,
            message=f"{seen}; {counted}",
            advice=(
                "Build it with jax.numpy inside the function (jnp.arange, not np.arange) so XLA"
                " generates it inside the kernel that uses it, or pass it as an argument; large"
                " constants also slow compilation."
            ),
            where=c.where,
            arrays=(c.name,),
            fixed_by_memsafe_jit=True,
        )


@register_finding("loop_invariant_temp")
def loop_invariant_temp(report: ReportView) -> Iterable[Finding]:
    """A loop carries, unchanged, a value built from iota and constants before the loop.

    Seed 002's f_filter_with_temp: a k-mesh computed outside ``fori_loop`` is held as a temporary
    for the whole loop; built inside the body it fuses into the body's kernel.
    """
    graph = report.graph
    for loop in report.loops:
        for state in loop.state:
            if not state.invariant or state.bytes < policy.INSPECT.min_bytes:
                continue
            inits = [graph.arrays[a] for a in state.init]
            if not inits or not all(_generated(report, a) for a in inits):
                continue
            producer = inits[0].producer
            trips = f" {loop.trip_count}" if loop.trip_count else ""
            yield Finding(
                rule="loop_invariant_temp",
                bytes=state.bytes,
                message=(
                    f"{loop.name} carries {graph.arrays[state.array].type}"
                    f" ({format_bytes(state.bytes)}) unchanged through its{trips} iterations;"
                    f" {producer} computes it before the loop from iota and constants only."
                ),
                advice=(
                    "Compute it inside the loop body (call the function that builds it there):"
                    " XLA then fuses it into the body's kernel instead of holding a temporary"
                    " for the whole loop."
                ),
                where=_where(report, producer),
                kernels=(loop.name, *(a.producer for a in inits if a.producer)),
                arrays=(state.array,),
                fixed_by_memsafe_jit=True,
            )


def _is_transpose(report: ReportView, kernel: Kernel) -> bool:
    if kernel.opcode == "transpose":
        return True
    insts = report.graph.fused(kernel.name)
    if kernel.opcode == "copy":
        inst = insts[0]
        operand = report.graph.instructions.get(inst.operands[0]) if inst.operands else None
        return operand is not None and operand.shape.layout != inst.shape.layout
    return kernel.opcode == "fusion" and any(i.opcode in TRANSPOSE_OPS for i in insts)


@register_finding("fft_transpose")
def fft_transpose(report: ReportView) -> Iterable[Finding]:
    """Transposes forced around FFTs because the FFT axes are not the last ones (f_fft3d)."""
    graph = report.graph
    transposes: dict[str, Kernel] = {}
    ffts: list[str] = []
    for kernel in report.kernels:
        if kernel.opcode != "fft":
            continue
        neighbours = [graph.arrays[a].producer for a in kernel.inputs]
        for out in kernel.outputs:
            neighbours.extend(graph.arrays[out].consumers)
        found = False
        for n in neighbours:
            if n and n not in transposes and _is_transpose(report, graph.kernels[n]):
                transposes[n] = graph.kernels[n]
                found = True
        if found:
            ffts.append(kernel.name)
    if not transposes:
        return
    extra = [
        graph.arrays[o]
        for t in transposes.values()
        for o in t.outputs
        if graph.arrays[o].role not in ("output",)
    ]
    cost = sum(a.bytes for a in extra)
    if cost < policy.INSPECT.min_bytes:
        return
    first = next(iter(transposes.values()))
    yield Finding(
        rule="fft_transpose",
        bytes=cost,
        message=(
            f"{len(transposes)} transpose kernel(s) ({', '.join(transposes)}) move data in and"
            f" out of the FFT layout around {', '.join(ffts)}; the transposed copies are"
            f" {format_bytes(cost)} of temporaries."
        ),
        advice=(
            "FFTs run over the last (minor) axes; keep the transformed axes last in your arrays"
            " (e.g. shape (2, N, N, N) with axes=(1, 2, 3) instead of (N, N, N, 2) with"
            " axes=(0, 1, 2)) so no transposes are needed."
        ),
        where=first.where,
        kernels=(*transposes, *ffts),
        arrays=tuple(a.name for a in extra),
        fixed_by_memsafe_jit=False,
    )


@register_finding("parallel_branches")
def parallel_branches(report: ReportView) -> Iterable[Finding]:
    """Independent heavy branches (FFTs, dots) whose results are live at once (f_fft_multi).

    XLA may run independent chains side by side and keep each chain's result until a final
    kernel combines them, so temporaries grow with the number of branches.
    """
    graph = report.graph
    by_comp: dict[str, list[Kernel]] = {}
    for k in report.kernels:
        by_comp.setdefault(k.computation, []).append(k)
    for kernels in by_comp.values():
        heavy = {k.name for k in kernels if _is_heavy(report, k)}
        if len(heavy) < policy.INSPECT.min_branches:
            continue
        position = {k.name: k.order for k in kernels}
        anc = {k.name: graph.ancestors(k.name) for k in kernels}
        live: list[tuple[Array, int, int, frozenset[str]]] = []
        for k in kernels:
            for out in k.outputs:
                array = graph.arrays[out]
                if array.role != "temporary" or array.bytes < policy.INSPECT.min_bytes:
                    continue
                ends = [
                    position.get(graph.top_level_in(c, k.computation), -1) for c in array.consumers
                ]
                heavy_anc = frozenset(({k.name} | anc[k.name]) & heavy)
                if heavy_anc:
                    live.append((array, k.order, max(ends, default=k.order), heavy_anc))
        best: tuple[int, list[Array]] = (0, [])
        for t in sorted({k.order for k in kernels}):
            now = sorted((x for x in live if x[1] <= t <= x[2]), key=lambda x: -x[0].bytes)
            picked: list[tuple[Array, int, int, frozenset[str]]] = []
            for cand in now:
                if all(_independent(cand, p, anc) for p in picked):
                    picked.append(cand)
            if len(picked) >= policy.INSPECT.min_branches:
                sizes = [p[0].bytes for p in picked]
                cost = sum(sizes) - max(sizes)
                if cost > best[0]:
                    best = (cost, [p[0] for p in picked])
        cost, arrays = best
        if cost < policy.INSPECT.min_bytes:
            continue
        yield Finding(
            rule="parallel_branches",
            bytes=cost,
            message=(
                f"{len(arrays)} independent branches of heavy kernels keep their results"
                f" ({', '.join(a.describe() for a in arrays)}) live at the same time."
            ),
            advice=(
                "Run the branches one after another with lax.fori_loop / lax.scan (accumulating"
                " as you go) so only one branch's temporaries exist at a time; on jax 0.10.2 CPU"
                " lax.optimization_barrier did not change XLA's schedule."
            ),
            where=_where(report, arrays[0].producer),
            kernels=tuple(a.producer for a in arrays if a.producer),
            arrays=tuple(a.name for a in arrays),
            fixed_by_memsafe_jit=True,
        )


def _independent(a, b, anc: dict[str, set[str]]) -> bool:
    pa, pb = a[0].producer, b[0].producer
    if pa == pb or pa in anc[pb] or pb in anc[pa]:
        return False
    return not (a[3] <= b[3] or b[3] <= a[3])


@register_finding("stored_across_barrier")
def stored_across_barrier(report: ReportView) -> Iterable[Finding]:
    """A cheap value stored across a reduction and re-read after it (seed 002's f_stored).

    Recomputing it in the kernel after the reduction costs a few flops; storing it costs its
    bytes for as long as the reduction runs.
    """
    graph = report.graph
    for kernel in report.kernels:
        if not _is_cheap(report, kernel):
            continue
        read = sum(a.bytes for a in _array_inputs(report, kernel))
        for out in kernel.outputs:
            array = graph.arrays[out]
            if (
                array.role != "temporary"
                or array.bytes < policy.INSPECT.min_bytes
                or read * 4 > array.bytes
            ):
                continue
            reducers = [
                c for c in array.consumers if _reduced_extent(report, graph.kernels[c]) is not None
            ]
            later = [
                c
                for c in array.consumers
                if any(r in graph.ancestors(c) for r in reducers) and c not in reducers
            ]
            if not reducers or not later:
                continue
            yield Finding(
                rule="stored_across_barrier",
                bytes=array.bytes,
                message=(
                    f"{array.describe()}, computed cheaply by {kernel.name}, is stored while"
                    f" {reducers[0]} reduces it and read again by {later[0]} after the reduction."
                ),
                advice=(
                    "Recompute it after the reduction instead of reusing the stored value: call"
                    " the function that builds it again (XLA's CSE merges identical expressions;"
                    " a different epsilon keeps them apart), so it fuses into the later kernel."
                ),
                where=kernel.where,
                kernels=(kernel.name, reducers[0], later[0]),
                arrays=(out,),
                fixed_by_memsafe_jit=False,
            )


@register_finding("broadcast_materialized")
def broadcast_materialized(report: ReportView) -> Iterable[Finding]:
    """A kernel that writes far more than it reads: a broadcast, tile or outer op materialized.

    Seed 000's tiled context (``jnp.tile(z[:, None], (1, N, 1))`` fed to an MLP) and the naive
    pairwise difference ``x[:, None] - y[None]`` are this pattern.
    """
    graph = report.graph
    for kernel in report.kernels:
        if kernel.opcode in ("while", "conditional", "call") or _is_heavy(report, kernel):
            continue
        if _ops(report, kernel) & {"reduce", "reduce-window"}:
            continue  # a reduction's result (a pairwise matrix), not a stored broadcast
        inputs = _array_inputs(report, kernel)
        read = sum(a.bytes for a in inputs)
        if not inputs and not _ops(report, kernel) <= FILL_OPS:
            continue  # generated from iota: the loop and barrier rules cover those
        for out in kernel.outputs:
            array = graph.arrays[out]
            if (
                array.role not in ("temporary", "loop state")
                or array.bytes < policy.INSPECT.broadcast_min_bytes
            ):
                continue
            if array.bytes < policy.INSPECT.expansion * read or _initializes_loop(report, array):
                continue
            source = (
                " from " + ", ".join(a.describe() for a in inputs) if inputs else " from a scalar"
            )
            ratio = f"{array.bytes / read:,.0f}x what it reads" if read else "a filled array"
            yield Finding(
                rule="broadcast_materialized",
                bytes=array.bytes,
                message=(
                    f"{kernel.name} materializes {array.describe()}{source}: {ratio}; a"
                    f" broadcast/tiled value is stored in memory between kernels."
                ),
                advice=(
                    "Keep the broadcast inside its consumer: pass the small array with"
                    " vmap(in_axes=None) instead of jnp.tile, split a layer that reads a"
                    " concatenation into one product per part (z @ W_z once per row), or let"
                    " memsafe.jit split the computation into chunks."
                ),
                where=kernel.where,
                kernels=(kernel.name,),
                arrays=(out,),
                fixed_by_memsafe_jit=False,
            )
