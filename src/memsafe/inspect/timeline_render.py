"""Drawings of memory timelines: a text bar chart, and SVG panels side by side on one scale.

Both mark the peak and list the buffers alive at it, so the plain and the memsafe program can be
read against each other: what is live when memory is highest, and how high that is.
"""

from __future__ import annotations

import html
from collections.abc import Sequence

from memsafe.inspect.timeline import KINDS, Timeline
from memsafe.limits import format_bytes

#: Rows of the text chart; longer schedules are shown in groups of steps (each its maximum).
TEXT_ROWS = 32
#: Width of the text chart's bars.
TEXT_WIDTH = 40
#: Buffers listed as alive at the peak.
ALIVE_ROWS = 8
#: Colours of the SVG's stacked areas, by buffer kind.
COLOURS = {
    "parameter": "#7fb77e",
    "output": "#e6c84f",
    "constant": "#c9a0dc",
    "temporary": "#6d9bd1",
}
#: An SVG panel's size in pixels, and its margins (left, right, top, bottom).
PANEL = (420, 220)
MARGIN = (70, 10, 34, 30)


def _groups(count: int, rows: int) -> list[range]:
    """Steps ``0..count-1`` in at most ``rows`` consecutive groups."""
    size = max(1, -(-count // rows))
    return [range(s, min(s + size, count)) for s in range(0, count, size)]


def alive_lines(timeline: Timeline, rows: int = ALIVE_ROWS) -> list[str]:
    """The buffers alive at the peak, largest first, one per line."""
    alive = timeline.alive_at(timeline.peak_step)
    out = [
        f"    {b.name:<30} {b.shape.split('{')[0]:<22} {format_bytes(b.bytes):>10}  {b.kind}"
        f"  (steps {b.start}-{b.end})"
        for b in alive[:rows]
    ]
    if len(alive) > rows:
        rest = sum(b.bytes for b in alive[rows:])
        out.append(f"    ... and {len(alive) - rows} smaller ({format_bytes(rest)})")
    return out


def text(timeline: Timeline, rows: int = TEXT_ROWS, width: int = TEXT_WIDTH) -> str:
    """The timeline as a bar chart, one row per step (or group of steps), the peak marked."""
    totals = timeline.totals
    peak, at = timeline.peak, timeline.peak_step
    out = [f"Memory timeline, {timeline.describe()}"]
    for group in _groups(len(totals), rows):
        top = max(group, key=lambda t: totals[t])
        if at in group:
            top = at
        bar = "#" * (round(width * totals[top] / peak) if peak else 0)
        label = f"{group.start}" if len(group) == 1 else f"{group.start}-{group[-1]}"
        mark = "  <- peak" if top == at else ""
        name = timeline.step_name(top)[:28]
        out.append(f"  {label:>9}  {name:<28} {format_bytes(totals[top]):>10} |{bar}{mark}")
    out.append(f"  alive at the peak (step {at}):")
    return "\n".join(out + alive_lines(timeline))


# -- svg ------------------------------------------------------------------------------------------


def _area(xs: list[float], lows: list[float], highs: list[float]) -> str:
    """A step-shaped polygon between two lines (one value per step)."""
    upper = [f"{x:.1f},{y:.1f}" for x, y in zip(xs, highs)]
    lower = [f"{x:.1f},{y:.1f}" for x, y in zip(reversed(xs), reversed(lows))]
    return " ".join(upper + lower)


def _panel(timeline: Timeline, scale: int, dx: float) -> list[str]:
    """One timeline's axes, stacked areas by kind, peak marker and title, offset by ``dx``."""
    w, h = PANEL
    left, right, top, bottom = MARGIN
    plot_w, plot_h = w - left - right, h - top - bottom
    n = max(len(timeline.live), 1)
    xs: list[float] = []
    for t in range(n):  # each step is a flat segment: its two ends
        xs += [dx + left + plot_w * t / n, dx + left + plot_w * (t + 1) / n]

    def y(value: float) -> float:
        return top + plot_h * (1 - value / scale) if scale else top + plot_h

    e = html.escape
    parts = [
        f'<text x="{dx + left}" y="{top - 18}" font-size="13" font-weight="bold">'
        f"{e(timeline.name)}</text>",
        f'<line x1="{dx + left}" y1="{top + plot_h}" x2="{dx + left + plot_w}" '
        f'y2="{top + plot_h}" stroke="#444"/>',
        f'<line x1="{dx + left}" y1="{top}" x2="{dx + left}" y2="{top + plot_h}" stroke="#444"/>',
        f'<text x="{dx + left - 4}" y="{top + 4}" font-size="10" text-anchor="end">'
        f"{e(format_bytes(scale))}</text>",
        f'<text x="{dx + left - 4}" y="{top + plot_h}" font-size="10" text-anchor="end">0</text>',
        f'<text x="{dx + left + plot_w / 2}" y="{h - 6}" font-size="10" text-anchor="middle">'
        f"schedule step (0-{n - 1})</text>",
    ]
    base = [0.0] * n
    for kind in KINDS:
        values = [base[t] + timeline.live[t][kind] for t in range(n)]
        if any(v != b for v, b in zip(values, base)):
            lows = [y(v) for v in base for _ in (0, 1)]
            highs = [y(v) for v in values for _ in (0, 1)]
            parts.append(
                f'<polygon points="{_area(xs, lows, highs)}" fill="{COLOURS[kind]}" '
                f'stroke="none"><title>{kind}</title></polygon>'
            )
        base = values
    at = timeline.peak_step
    px = dx + left + plot_w * (at + 0.5) / n
    parts += [
        f'<line class="peak" x1="{px:.1f}" y1="{top - 4}" x2="{px:.1f}" y2="{top + plot_h}" '
        f'stroke="#d62728" stroke-dasharray="4,2"/>',
        f'<text x="{px:.1f}" y="{top - 6}" font-size="10" fill="#d62728" text-anchor="middle">'
        f"peak {e(format_bytes(timeline.peak))} at {e(timeline.step_name(at) or str(at))}"
        "</text>",
    ]
    return parts


def svg(timelines: Sequence[Timeline]) -> str:
    """The timelines as SVG panels side by side, on one byte scale, with a legend."""
    if not timelines:
        raise ValueError("svg() needs at least one timeline")
    scale = max(t.peak for t in timelines) or 1
    w, h = PANEL
    width, height = w * len(timelines), h + 18
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="memsafe-timeline" width="{width}" '
        f'height="{height}" viewBox="0 0 {width} {height}" font-family="Helvetica, Arial">'
    ]
    for i, timeline in enumerate(timelines):
        parts += _panel(timeline, scale, i * w)
    x = MARGIN[0]
    for kind in KINDS:
        parts.append(
            f'<rect x="{x}" y="{h + 4}" width="10" height="10" fill="{COLOURS[kind]}"/>'
            f'<text x="{x + 14}" y="{h + 13}" font-size="10">{kind}</text>'
        )
        x += 90
    return "\n".join([*parts, "</svg>"])


def html_section(timelines: Sequence[Timeline]) -> str:
    """The HTML of a report's timeline section: the SVG, and the buffers alive at each peak."""
    e = html.escape
    columns = []
    for t in timelines:
        alive = "\n".join(alive_lines(t))
        columns.append(
            f"<div><h4>{e(t.name)}: peak {e(format_bytes(t.peak))}</h4>"
            f"<pre>alive at the peak (step {t.peak_step}):\n{e(alive)}</pre></div>"
        )
    return (
        "<h3>Memory timeline</h3>"
        + svg(timelines)
        + '<div class="side">'
        + "".join(columns)
        + "</div>"
    )
