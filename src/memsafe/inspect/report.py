"""``memsafe.inspect(f, *args)``: compile ``f`` and report where its memory goes.

The report is assembled from public ``jax.stages`` calls only: the traced jaxpr (for closed-over
constants), the optimized HLO text (kernels, arrays, loops, folded constants) and
``memory_analysis()`` (the footprint).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from memsafe import _jax, policy
from memsafe.batching import planning
from memsafe.inspect import render
from memsafe.inspect.findings import find_all
from memsafe.inspect.graph import ProgramGraph, build_graph
from memsafe.inspect.hlo import parse_hlo
from memsafe.inspect.model import Array, Constant, Finding, Kernel, Loop
from memsafe.inspect.timeline import Timeline, compile_with_timeline
from memsafe.limits import format_bytes
from memsafe.plan import Plan
from memsafe.xla import Footprint
from memsafe.xla import compiler_options as memsafe_compiler_options

_NUMPY_TO_HLO = {
    "bool": "pred",
    "int8": "s8",
    "int16": "s16",
    "int32": "s32",
    "int64": "s64",
    "uint8": "u8",
    "uint16": "u16",
    "uint32": "u32",
    "uint64": "u64",
    "float16": "f16",
    "bfloat16": "bf16",
    "float32": "f32",
    "float64": "f64",
    "complex64": "c64",
    "complex128": "c128",
}


def hlo_dtype(dtype: Any) -> str:
    """HLO's name of a NumPy/JAX dtype (``float32`` -> ``f32``)."""
    name = str(np.dtype(dtype)) if not isinstance(dtype, str) else dtype
    return _NUMPY_TO_HLO.get(name, name)


@dataclass
class Report:
    """What XLA built for a function: kernels, arrays, loops, constants, footprint, findings."""

    name: str
    arguments: list[str]  # how each argument was passed (shape or "static ...")
    mode: str  # which compiler options were used
    kernels: list[Kernel]
    arrays: list[Array]
    loops: list[Loop]
    constants: list[Constant]
    footprint: Footprint
    peak_memory_in_bytes: int | None
    hlo: str = field(repr=False)
    graph: ProgramGraph = field(repr=False)
    findings: list[Finding] = field(default_factory=list)
    timeline: Timeline | None = None  # live bytes along XLA's schedule of this program
    memsafe_timeline: Timeline | None = None  # the same for memsafe.jit's program (memory_limit=)
    plan: Plan | None = None  # memsafe.jit's plan (memory_limit=)
    notes: list[str] = field(default_factory=list)  # why a timeline is missing, and the like

    # -- lookups ------------------------------------------------------------------------------

    def kernel(self, name: str) -> Kernel:
        return self.graph.kernels[name]

    def array(self, name: str) -> Array:
        return self.graph.arrays[name]

    @property
    def temporaries(self) -> list[Array]:
        """Arrays between kernels (not parameters, outputs or constants), largest first."""
        temps = [a for a in self.arrays if a.role in ("temporary", "loop state")]
        return sorted(temps, key=lambda a: -a.bytes)

    @property
    def top_level_kernels(self) -> list[Kernel]:
        return [k for k in self.kernels if k.parent is None]

    def finding(self, rule: str) -> list[Finding]:
        return [f for f in self.findings if f.rule == rule]

    # -- renderings ---------------------------------------------------------------------------

    @property
    def timelines(self) -> list[Timeline]:
        """The plain program's timeline, then memsafe.jit's when ``memory_limit`` was given."""
        return [t for t in (self.timeline, self.memsafe_timeline) if t is not None]

    def __str__(self) -> str:
        return render.text(self)

    def __repr__(self) -> str:
        count = len(self.findings)
        return (
            f"<memsafe.inspect Report {summary_line(self)}; {len(self.kernels)} kernels,"
            f" {count} finding{'' if count == 1 else 's'}; print() it for the tables>"
        )

    def dot(self) -> str:
        return render.dot(self)

    def svg(self) -> str:
        return render.svg(self)

    def html(self) -> str:
        """A standalone HTML page (what :meth:`save` writes for ``.html``)."""
        return render.page(self)

    def _repr_html_(self) -> str:
        """An HTML fragment with scoped styles (what Jupyter shows)."""
        return render.html(self)

    def save(self, path: str) -> None:
        """Write the report: ``.html`` (default), ``.svg``, ``.dot`` or ``.txt`` by extension."""
        from pathlib import Path

        target = Path(path)
        suffix = target.suffix.lower()
        if suffix == ".svg":
            content = self.svg()
        elif suffix in (".dot", ".gv"):
            content = self.dot()
        elif suffix == ".txt":
            content = str(self)
        else:
            content = self.html()
        target.write_text(content, encoding="utf-8")


# -- arguments ----------------------------------------------------------------------------------


def _is_array_leaf(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic | jax.ShapeDtypeStruct)


def _is_dynamic(x: Any) -> bool:
    """Arrays and pytrees of arrays are traced; anything else is static."""
    leaves = jax.tree_util.tree_leaves(x)
    return bool(leaves) and all(_is_array_leaf(leaf) for leaf in leaves)


def _describe_arg(x: Any) -> str:
    if _is_dynamic(x):
        leaves = jax.tree_util.tree_leaves(x)
        parts = [f"{hlo_dtype(leaf.dtype)}[{','.join(map(str, leaf.shape))}]" for leaf in leaves]
        return parts[0] if len(parts) == 1 else "{" + ", ".join(parts) + "}"
    text = repr(x)
    return "static " + (text if len(text) < 40 else text[:37] + "...")


def _function_name(f: Callable[..., Any]) -> str:
    while isinstance(f, functools.partial):
        f = f.func
    return getattr(f, "__qualname__", None) or getattr(f, "__name__", None) or repr(f)


def _options(compiler_options: Mapping[str, Any] | str | None) -> tuple[dict[str, Any], str]:
    if isinstance(compiler_options, str):
        if compiler_options != "memsafe":
            raise ValueError(
                f"compiler_options must be 'memsafe', None or a dict, not {compiler_options!r}"
            )
        options = memsafe_compiler_options()
        shown = ", ".join(f"{k}={v!r}" for k, v in options.items()) or "none needed here"
        return options, f"memsafe compiler options ({shown})"
    if compiler_options is None:
        return {}, "XLA default compiler options"
    if not isinstance(compiler_options, Mapping):
        raise ValueError(
            "compiler_options must be 'memsafe', None or a dict of XLA options, "
            f"not {type(compiler_options).__name__}"
        )
    options = dict(compiler_options)
    return options, "compiler options " + (", ".join(f"{k}={v!r}" for k, v in options.items()))


# -- constants ----------------------------------------------------------------------------------


def _closed_over(jaxpr: Any) -> list[Constant]:
    """Closed-over arrays of the traced program, with the first line that uses each."""
    out: list[Constant] = []
    consts = list(getattr(jaxpr, "consts", ()))
    constvars = list(jaxpr.jaxpr.constvars)
    for var, value in zip(constvars, consts):
        nbytes = int(getattr(value, "nbytes", 0) or 0)
        if nbytes <= policy.INSPECT.constant_threshold or not hasattr(value, "shape"):
            continue
        where = ""
        for eqn in jaxpr.jaxpr.eqns:
            if any(v is var for v in eqn.invars):
                where = _jax.source_line(eqn)
                break
        out.append(
            Constant(
                name=f"closed-over {hlo_dtype(value.dtype)}{list(value.shape)}",
                shape=tuple(int(d) for d in value.shape),
                dtype=hlo_dtype(value.dtype),
                bytes=nbytes,
                kind="hidden",
                counted=False,
                where=where,
                closed_over=True,
            )
        )
    return out


def _constants(graph: ProgramGraph, hidden: list[Constant], generated_code: int) -> list[Constant]:
    """Folded HLO constants merged with the closed-over arrays they came from."""
    folded: list[Constant] = []
    for comp in graph.module.computations.values():
        for inst in comp.instructions:
            if inst.opcode != "constant" or inst.shape.bytes <= policy.INSPECT.constant_threshold:
                continue
            folded.append(
                Constant(
                    name=inst.name,
                    shape=inst.shape.dims,
                    dtype=inst.shape.dtype,
                    bytes=inst.shape.bytes,
                    kind="folded",
                    counted=generated_code >= inst.shape.bytes,
                    where=str(inst.source) if inst.source else "",
                )
            )
    remaining = list(hidden)
    for c in folded:
        for h in remaining:
            if h.dtype == c.dtype and h.shape == c.shape:
                c.closed_over = True
                c.where = c.where or h.where
                remaining.remove(h)
                break
    return folded + remaining


# -- the entry point ----------------------------------------------------------------------------


def _footprint(compiled: Any, constants: list[Constant]) -> tuple[Footprint, int | None]:
    """The compiled program's footprint (with the constants it does not count) and XLA's peak."""
    stats = compiled.memory_analysis()
    footprint = Footprint(
        arguments=int(stats.argument_size_in_bytes),
        outputs=int(stats.output_size_in_bytes),
        temps=int(stats.temp_size_in_bytes),
        aliases=int(stats.alias_size_in_bytes),
        generated_code=int(getattr(stats, "generated_code_size_in_bytes", 0) or 0),
        hidden_constants=sum(c.bytes for c in constants if not c.counted),
    )
    peak = getattr(stats, "peak_memory_in_bytes", None)
    return footprint, None if peak is None else int(peak)


def _memsafe_side(
    f: Callable[..., Any], args: tuple, kwargs: dict, limit: int | str, static: tuple
) -> tuple[Plan, Timeline | None, str]:
    """memsafe.jit's plan and timeline for the same function and arguments."""
    from memsafe.jit import jit

    safe = jit(f, memory_limit=limit, static_argnums=static[0], static_argnames=static[1])
    plan = safe.plan(*args, **kwargs)
    lowered = safe.lower(*args, **kwargs).lowered  # JAX's own Lowered of the verified program
    _, timeline, why = compile_with_timeline(lowered, "memsafe.jit")
    return plan, timeline, why


def inspect(
    f: Callable[..., Any],
    *args: Any,
    compiler_options: Mapping[str, Any] | str | None = "memsafe",
    memory_limit: int | str | None = None,
    **kwargs: Any,
) -> Report:
    """Compile ``f`` at ``args`` and report its kernels, arrays, constants, footprint, findings.

    Arrays (and pytrees of arrays, or ``jax.ShapeDtypeStruct``) are traced; any other argument is
    static. ``compiler_options="memsafe"`` (default) compiles as ``memsafe.jit`` does, with XLA's
    CPU YNNPACK fusions off so every buffer is accounted for; ``None`` uses XLA's defaults; a
    dict passes options to XLA. The report's ``timeline`` is the memory live along XLA's schedule
    of the program; with ``memory_limit`` the report also holds ``memsafe.jit``'s ``plan`` and
    ``memsafe_timeline``, drawn beside the plain one.
    """
    if not callable(f):
        raise TypeError(f"memsafe.inspect needs a function, got {type(f).__name__}")
    options, mode = _options(compiler_options)
    name = _function_name(f)
    static = (
        tuple(i for i, a in enumerate(args) if not _is_dynamic(a)),
        tuple(k for k, v in kwargs.items() if not _is_dynamic(v)),
    )
    described = [_describe_arg(a) for a in args] + [
        f"{k}={_describe_arg(v)}" for k, v in kwargs.items()
    ]
    jit_kwargs: dict[str, Any] = {"static_argnums": static[0], "static_argnames": static[1]}
    if options:
        jit_kwargs["compiler_options"] = options
    trace = jax.jit(f, **jit_kwargs).trace
    if compiler_options == "memsafe":  # memsafe's own options: a memsafe function inside is fine
        trace = planning(trace)
    try:
        traced = trace(*args, **kwargs)
    except Exception as err:  # the user's own error, kept as it is, with where memsafe was
        err.add_note(f"memsafe.inspect: while tracing {name} at arguments ({', '.join(described)})")
        raise
    compiled, timeline, why = compile_with_timeline(traced.lower(), "jax.jit")
    hlo = compiled.as_text()
    graph = build_graph(parse_hlo(hlo))
    generated = int(getattr(compiled.memory_analysis(), "generated_code_size_in_bytes", 0) or 0)
    constants = _constants(graph, _closed_over(traced.jaxpr), generated)
    footprint, peak = _footprint(compiled, constants)
    report = Report(
        name=name,
        arguments=described,
        mode=mode,
        kernels=list(graph.kernels.values()),
        arrays=list(graph.arrays.values()),
        loops=list(graph.loops.values()),
        constants=constants,
        footprint=footprint,
        peak_memory_in_bytes=peak,
        hlo=hlo,
        graph=graph,
        timeline=timeline,
        notes=[why] if why else [],
    )
    if memory_limit is not None:
        report.plan, report.memsafe_timeline, why = _memsafe_side(
            f, args, kwargs, memory_limit, static
        )
        report.notes += [why] if why else []
    report.findings = find_all(report)
    return report


def summary_line(report: Report) -> str:
    """One line: the function, its footprint and its largest temporary."""
    temps = report.temporaries
    largest = f", largest temporary {temps[0].describe()}" if temps else ""
    return f"{report.name}: {format_bytes(report.footprint.total)}{largest}"
