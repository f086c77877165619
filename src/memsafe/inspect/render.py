"""Renderings of a report: a text table, a Graphviz picture (DOT and SVG) and an HTML page.

The picture draws kernels as boxes, loop bodies as clusters and every array as an edge labelled
with its bytes; the largest temporaries are drawn thick and red. SVG comes from the system ``dot``
if present, else from ``graphviz-pure`` (a ``dot``-compatible binary installed with memsafe).
"""

from __future__ import annotations

import html as _html
import shutil
import subprocess
import sys
from pathlib import Path

import graphviz

from memsafe.display import document, fragment, table
from memsafe.inspect import timeline_render
from memsafe.inspect.hlo import Source
from memsafe.inspect.model import Array, Constant, Kernel
from memsafe.inspect.view import ReportView
from memsafe.limits import format_bytes
from memsafe.sources import short_location

#: How many of the largest temporaries the picture highlights.
HIGHLIGHT = 1
#: Rows of the text table's array list.
MAX_ARRAY_ROWS = 25


def short(source: Source | str | None) -> str:
    """``file.py:12 (fn)`` with the directory dropped, a notebook cell as ``cell [3]:12 (fn)``."""
    return short_location(str(source)) if source else ""


def _kernel_where(kernel: Kernel) -> str:
    return short(kernel.sources[0]) if kernel.sources else ""


def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))

    def fmt(cells: list[str]) -> str:
        parts = [
            c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(cells)
        ]
        return "  " + "  ".join(parts).rstrip()

    return [fmt(headers), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


# -- text ---------------------------------------------------------------------------------------


def footprint_lines(report: ReportView) -> list[str]:
    fp = report.footprint
    lines = [
        f"Footprint: {format_bytes(fp.total)} ({fp.total:,} bytes)",
        f"  arguments {format_bytes(fp.arguments)} + outputs {format_bytes(fp.outputs)}"
        f" + temps {format_bytes(fp.temps)} - aliases {format_bytes(fp.aliases)}"
        f" + generated code {format_bytes(fp.generated_code)}"
        f" + constants memory_analysis() does not count {format_bytes(fp.hidden_constants)}",
    ]
    if report.peak_memory_in_bytes is not None:
        lines.append(
            f"  XLA's peak_memory_in_bytes: {format_bytes(report.peak_memory_in_bytes)}"
            " (on CPU it omits temps; the total above does not)"
        )
    return lines


def text(report: ReportView) -> str:
    """The report as a readable table: header, footprint, then one section per part."""
    out = [
        f"memsafe.inspect: {report.name}({', '.join(report.arguments)})",
        f"compiled with {report.mode}",
        "",
        *footprint_lines(report),
    ]
    for section in _SECTIONS:
        lines = section(report)
        if lines:
            out += ["", *lines]
    return "\n".join(out)


def _loop_of(kernel: Kernel) -> str:
    return f"in {kernel.parent}" if kernel.parent else ""


def _kernels_section(report: ReportView) -> list[str]:
    """Every kernel in schedule order: its op, what it writes, its loop and source line."""
    rows = [
        [k.name, k.label, str(k.shape), format_bytes(k.bytes), _loop_of(k), _kernel_where(k)]
        for k in report.kernels
    ]
    return [
        f"Kernels ({len(report.kernels)}, in schedule order):",
        *_table(["kernel", "op", "writes", "bytes", "loop", "source"], rows, {3}),
    ]


def _temporaries_section(report: ReportView) -> list[str]:
    """The largest arrays between kernels (at most :data:`MAX_ARRAY_ROWS`), who writes and reads
    them; a loop's next state is read by the loop's next iteration."""
    temps = report.temporaries
    carried = {u: loop.name for loop in report.loops for st in loop.state for u in st.update}

    def readers(a: Array) -> str:
        if a.consumers:
            return ", ".join(a.consumers)
        return f"next iteration of {carried[a.name]}" if a.name in carried else "-"

    rows = [
        [a.name, a.type, format_bytes(a.bytes), a.role, a.producer or "", readers(a)]
        for a in temps[:MAX_ARRAY_ROWS]
    ]
    out = [f"Arrays between kernels ({len(temps)} temporaries, largest first):"]
    out += _table(["array", "type", "bytes", "role", "producer", "consumers"], rows, {2})
    if len(temps) > MAX_ARRAY_ROWS:
        out.append(f"  ... and {len(temps) - MAX_ARRAY_ROWS} smaller")
    return out


def _io_section(report: ReportView) -> list[str]:
    """Parameters and outputs with the kernels that read them (empty if there are none)."""
    rows = [
        [a.name, a.type, format_bytes(a.bytes), a.role, ", ".join(a.consumers) or "-"]
        for a in report.arrays
        if a.role in ("parameter", "output")
    ]
    if not rows:
        return []
    return [
        "Parameters and outputs:",
        *_table(["array", "type", "bytes", "role", "read by"], rows, {2}),
    ]


def _loops_section(report: ReportView) -> list[str]:
    """Each loop's trip count and carried state, updated or loop-invariant (empty if none)."""
    if not report.loops:
        return []
    out = ["Loops:"]
    for loop in report.loops:
        trips = f"{loop.trip_count} iterations" if loop.trip_count else "unknown trip count"
        out.append(f"  {loop.name} ({trips}), carried state {format_bytes(loop.bytes)}:")
        for s in loop.state:
            arr = report.graph.arrays.get(s.array)
            kind = "unchanged (loop-invariant)" if s.invariant else "updated"
            out.append(f"    [{s.index}] {arr.type if arr else '?'} {format_bytes(s.bytes)} {kind}")
    return out


def _constant_kind(c: Constant) -> str:
    return c.kind + (" (closed over)" if c.closed_over else "")


def _constants_section(report: ReportView) -> list[str]:
    """Constants, whether memory_analysis() counts them and where they come from (empty if none)."""
    rows = [
        [
            c.name,
            c.type,
            format_bytes(c.bytes),
            _constant_kind(c),
            "yes" if c.counted else "no",
            short(c.where),
        ]
        for c in report.constants
    ]
    if not rows:
        return []
    headers = ["constant", "type", "bytes", "kind", "counted", "source"]
    return ["Constants:", *_table(headers, rows, {2})]


#: What the text says about who fixes a finding (``Finding.fixed_by_memsafe_jit``).
_FIX = {True: "memsafe.jit fixes this", False: "fix it in your code", None: ""}


def _findings_section(report: ReportView) -> list[str]:
    """Each finding: its bytes and place, message and advice (``none`` when there are none)."""
    out = [f"Findings ({len(report.findings)}):"]
    if not report.findings:
        out.append("  none")
    for f in report.findings:
        fix = _FIX[f.fixed_by_memsafe_jit]
        where = f" at {short(f.where)}" if f.where else ""
        out.append(f"  [{f.rule}] {format_bytes(f.bytes)} ({f.bytes:,} bytes){where}")
        out.append(f"      {f.message}")
        out.append(f"      advice: {f.advice}" + (f" ({fix})" if fix else ""))
    return out


#: The text's sections in order; each returns its lines, or none to leave the section out.
def _timelines_section(report: ReportView) -> list[str]:
    """Live bytes along XLA's schedule, for each compiled program (empty if none)."""
    out: list[str] = []
    for timeline in report.timelines:
        out += ["", timeline_render.text(timeline)] if out else [timeline_render.text(timeline)]
    return out


def _notes_section(report: ReportView) -> list[str]:
    return [f"({note})" for note in report.notes]


_SECTIONS = (
    _kernels_section,
    _temporaries_section,
    _io_section,
    _loops_section,
    _constants_section,
    _findings_section,
    _timelines_section,
    _notes_section,
)


# -- graphviz -----------------------------------------------------------------------------------


def _edge_label(a: Array) -> str:
    return f"{a.type}\\n{format_bytes(a.bytes)}"


def dot(report: ReportView) -> str:
    """The kernel graph as Graphviz DOT source."""
    graph = graphviz.Digraph(name=report.name, format="svg")
    graph.attr(rankdir="TB", fontname="Helvetica", label=f"{report.name}: {report.mode}")
    graph.attr("node", fontname="Helvetica", fontsize="10")
    graph.attr("edge", fontname="Helvetica", fontsize="9")
    _add_kernels(report, graph, None)
    _add_inputs(report, graph)
    _add_array_edges(report, graph)
    _add_loop_edges(report, graph)
    _add_outputs(report, graph)
    return graph.source


def _kernel_node(report: ReportView, container: graphviz.Digraph, k: Kernel) -> None:
    g = report.graph
    lines = [k.name, k.label, f"{k.shape} {format_bytes(k.bytes)}"]
    if k.sources:
        lines.append(short(k.sources[0]))
    if k.opcode == "while" and k.name in g.loops and g.loops[k.name].trip_count:
        lines[1] += f" ({g.loops[k.name].trip_count} iterations)"
    fill = "#e8eef7" if k.opcode == "fusion" else "#f7eee0"
    container.node(k.name, "\\n".join(lines), shape="box", style="rounded,filled", fillcolor=fill)


def _add_kernels(report: ReportView, container: graphviz.Digraph, parent: str | None) -> None:
    """The kernels under ``parent``, loop bodies as dashed clusters."""
    for k in report.kernels:
        if k.parent != parent:
            continue
        _kernel_node(report, container, k)
        if any(c.parent == k.name for c in report.kernels):
            with container.subgraph(name=f"cluster_{k.name}") as sub:
                sub.attr(label=f"body of {k.name}", style="dashed", color="#888888")
                _add_kernels(report, sub, k.name)


def _add_inputs(report: ReportView, graph: graphviz.Digraph) -> None:
    for a in report.arrays:
        if a.role == "parameter":
            label, shape, fill = f"{a.name}", "ellipse", "#e3f2e1"
        elif a.role == "constant" and a.consumers:
            label, shape, fill = f"constant {a.name}", "note", "#fde2e2"
        else:
            continue
        text = f"{label}\\n{a.type}\\n{format_bytes(a.bytes)}"
        graph.node(f"in__{a.name}", text, shape=shape, style="filled", fillcolor=fill)


def _add_array_edges(report: ReportView, graph: graphviz.Digraph) -> None:
    """Arrays as edges from producer to consumers, the largest temporaries in red."""
    highlighted = {a.name for a in report.temporaries[:HIGHLIGHT] if a.bytes > 0}
    for a in report.arrays:
        source = a.producer if a.producer else f"in__{a.name}"
        if source.startswith("in__") and a.role not in ("parameter", "constant"):
            continue
        attrs = {"label": _edge_label(a)}
        if a.name in highlighted:
            attrs.update(color="red", penwidth="3", fontcolor="red")
        if a.role == "loop state":
            attrs["style"] = "dashed"
        for c in a.consumers:
            graph.edge(source, c, **attrs)


def _add_loop_edges(report: ReportView, graph: graphviz.Digraph) -> None:
    """Each loop's next state, dotted from its producer back to the loop."""
    g = report.graph
    for loop in report.loops:
        for s in loop.state:
            for u in s.update:
                producer = g.arrays[u].producer
                if producer and producer != loop.name and not s.invariant:
                    label = f"next {_edge_label(g.arrays[u])}"
                    graph.edge(producer, loop.name, label=label, style="dotted", constraint="false")


def _add_outputs(report: ReportView, graph: graphviz.Digraph) -> None:
    g = report.graph
    for name in g.outputs:
        a = g.arrays[name]
        text = f"output\\n{a.type}\\n{format_bytes(a.bytes)}"
        graph.node(f"out__{name}", text, shape="ellipse", style="filled", fillcolor="#fff4c2")
        graph.edge(a.producer or f"in__{name}", f"out__{name}", label=_edge_label(a))


def dot_binary() -> str:
    """The ``dot`` executable: the system's, else ``graphviz-pure`` next to Python or on PATH."""
    found = shutil.which("dot")
    if found:
        return found
    beside = Path(sys.executable).parent / "graphviz-pure"
    if beside.exists():
        return str(beside)
    found = shutil.which("graphviz-pure")
    if found:
        return found
    raise RuntimeError(
        "cannot draw the report: no Graphviz 'dot' on PATH and no 'graphviz-pure' next to "
        f"{sys.executable}; install graphviz or `pip install graphviz-pure`"
    )


def svg(report: ReportView) -> str:
    """The kernel graph rendered to SVG."""
    result = subprocess.run(
        [dot_binary(), "-Tsvg"],
        input=dot(report).encode(),
        capture_output=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"Graphviz failed: {result.stderr.decode(errors='replace')[:500]}")
    out = result.stdout.decode()
    start = out.find("<svg")
    return out[start:] if start >= 0 else out


# -- html ---------------------------------------------------------------------------------------


def _findings_html(report: ReportView) -> list[str]:
    e = _html.escape
    parts = [f"<h3>Findings ({len(report.findings)})</h3>"]
    for f in report.findings:
        fix = (
            ' <span class="fixed">(memsafe.jit fixes this)</span>' if f.fixed_by_memsafe_jit else ""
        )
        where = f" at <code>{e(short(f.where))}</code>" if f.where else ""
        kind = "finding split" if f.fixed_by_memsafe_jit else "finding"
        parts.append(
            f'<div class="{kind}"><b>{e(f.rule)}</b>: {e(format_bytes(f.bytes))}'
            f" ({f.bytes:,} bytes){where}<br>{e(f.message)}<br><i>{e(f.advice)}</i>{fix}</div>"
        )
    if not report.findings:
        parts.append("<p>none</p>")
    return parts


def _tables_html(report: ReportView) -> list[str]:
    rows = [
        [k.name, k.label, str(k.shape), format_bytes(k.bytes), k.parent or "", _kernel_where(k)]
        for k in report.kernels
    ]
    parts = [
        "<h3>Kernels</h3>",
        table(["kernel", "op", "writes", "bytes", "loop", "source"], rows, {3}),
    ]
    rows = [
        [a.name, a.type, format_bytes(a.bytes), a.role, a.producer or "", ", ".join(a.consumers)]
        for a in sorted(report.arrays, key=lambda a: -a.bytes)
    ]
    headers = ["array", "type", "bytes", "role", "producer", "consumers"]
    parts += ["<h3>Arrays</h3>", table(headers, rows, {2})]
    if report.constants:
        rows = [
            [
                c.name,
                c.type,
                format_bytes(c.bytes),
                c.kind,
                "yes" if c.counted else "no",
                short(c.where),
            ]
            for c in report.constants
        ]
        headers = ["constant", "type", "bytes", "kind", "counted", "source"]
        parts += ["<h3>Constants</h3>", table(headers, rows, {2})]
    return parts


def body(report: ReportView, picture: bool = True) -> str:
    """The report's HTML, without a document or styles around it."""
    e = _html.escape
    parts = [
        f"<h3>memsafe.inspect: <code>{e(report.name)}</code>"
        f"({e(', '.join(report.arguments))})</h3>",
        f"<p>Compiled with {e(report.mode)}.</p>",
        "<h4>Footprint</h4><pre>" + e("\n".join(footprint_lines(report))) + "</pre>",
        *_findings_html(report),
    ]
    if report.timelines:
        parts.append(timeline_render.html_section(report.timelines))
    parts += [f"<p><i>{e(note)}</i></p>" for note in report.notes]
    if picture:
        try:
            parts.append("<h3>Kernel graph</h3>" + svg(report))
        except (RuntimeError, OSError, subprocess.SubprocessError) as err:
            parts.append(f"<p>(no picture: {e(str(err))})</p>")
    return "\n".join(parts + _tables_html(report))


def html(report: ReportView, picture: bool = True) -> str:
    """An HTML fragment with styles scoped to it (what Jupyter shows)."""
    return fragment(body(report, picture))


def page(report: ReportView, picture: bool = True) -> str:
    """A standalone HTML page holding the fragment (what ``report.save("r.html")`` writes)."""
    return document(f"memsafe.inspect {report.name}", body(report, picture))
