"""HTML fragments for notebooks: reports and plans shown without restyling the page around them.

Jupyter inserts ``_repr_html_`` output into the notebook's own page, so a fragment has no
``<html>``/``<head>``/``<body>`` and its ``<style>`` rules all start with a class unique to that
fragment (:func:`fragment`); two reports on one page, or the notebook's own elements, are not
touched by each other's styles.
"""

from __future__ import annotations

import html
import itertools
import os
import re
from collections.abc import Iterable

#: The class every fragment's root element carries, beside its unique one.
ROOT_CLASS = "memsafe-display"

#: Rules of the fragments' style sheet; each selector is scoped under the fragment's class.
STYLE_RULES: tuple[tuple[str, str], ...] = (
    ("", "font-family: Helvetica, Arial, sans-serif; font-size: 13px; line-height: 1.4;"),
    ("table", "border-collapse: collapse; margin: 0.4em 0 1em; font-size: 12px;"),
    ("th, td", "border: 1px solid #ccc; padding: 2px 7px; text-align: left;"),
    ("td.num", "text-align: right; font-variant-numeric: tabular-nums;"),
    ("h3, h4", "margin: 0.9em 0 0.3em;"),
    ("pre", "font-size: 12px; background: #f6f6f6; padding: 4px 8px; overflow-x: auto;"),
    (".finding", "border-left: 4px solid #d9534f; padding: 4px 10px; margin: 6px 0;"),
    (".finding.split", "border-left-color: #2b7a2b;"),
    (".fixed", "color: #2b7a2b;"),
    (".cost", "color: #b94a00;"),
    (".side", "display: flex; flex-wrap: wrap; gap: 16px; align-items: flex-start;"),
    ("code", "background: #f3f3f3; padding: 0 3px;"),
)

_counter = itertools.count()


def scope_class() -> str:
    """A class name no other fragment of this process (or, very likely, another) uses."""
    return f"memsafe-{os.getpid():x}-{next(_counter)}-{os.urandom(3).hex()}"


def scoped_style(scope: str, rules: Iterable[tuple[str, str]] = STYLE_RULES) -> str:
    """A ``<style>`` element whose every selector is prefixed with ``.scope``.

    Args:
        scope: the fragment's class.
        rules: (selector, declarations) pairs; ``""`` styles the fragment's root itself; a
            selector list ``"th, td"`` is scoped part by part.

    Returns:
        The ``<style>`` element.
    """
    out = []
    for selector, body in rules:
        parts = [s.strip() for s in selector.split(",")] if selector else [""]
        scoped = ", ".join(f".{scope} {p}".rstrip() for p in parts)
        out.append(f"{scoped} {{ {body} }}")
    return "<style>" + "\n".join(out) + "</style>"


def fragment(body: str, scope: str | None = None) -> str:
    """Wrap ``body`` in a ``<div>`` with its own scoped style sheet.

    Args:
        body: HTML for inside the fragment (no document-level elements).
        scope: the class to scope with (a new unique one when None).

    Returns:
        ``<div class="memsafe-display SCOPE"><style>...</style>BODY</div>``.
    """
    scope = scope or scope_class()
    return f'<div class="{ROOT_CLASS} {scope}">{scoped_style(scope)}{body}</div>'


def document(title: str, body: str) -> str:
    """A standalone HTML page holding one fragment (what a saved report is)."""
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title></head>"
        f"<body style='margin: 1.5em'>{fragment(body)}</body></html>"
    )


def table(headers: list[str], rows: list[list[str]], numeric: Iterable[int] = ()) -> str:
    """An HTML table of text cells (escaped); columns in ``numeric`` are right-aligned."""
    numbers = set(numeric)
    e = html.escape
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{e(c)}</td>' if i in numbers else f"<td>{e(c)}</td>"
            for i, c in enumerate(r)
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def selectors(style: str) -> list[str]:
    """The selectors of a ``<style>`` element's rules (what a test checks the scoping of)."""
    inner = re.sub(r"</?style>", "", style)
    return [s.strip() for s in re.findall(r"([^{}]+)\{[^{}]*\}", inner)]
