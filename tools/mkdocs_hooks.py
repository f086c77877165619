"""mkdocs hooks: render ```graphviz fenced blocks to inline SVG when the site is built.

The diagram is drawn by the same Graphviz ``dot`` that ``memsafe.inspect`` uses (the system's, or
``graphviz-pure``, a memsafe dependency), so the site needs no JavaScript or network to show it.
A block that fails to render fails the build.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

_FENCE = re.compile(r"^```graphviz[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)


def _render(source: str) -> str:
    from memsafe.inspect.render import dot_binary

    result = subprocess.run(
        [dot_binary(), "-Tsvg"], input=source.encode(), capture_output=True, timeout=120
    )
    if result.returncode != 0:
        raise RuntimeError(f"graphviz failed: {result.stderr.decode(errors='replace')[:500]}")
    svg = result.stdout.decode()
    svg = svg[svg.find("<svg") :]
    svg = re.sub(r"<!--.*?-->", "", svg, flags=re.S)
    # One line per element and no blank lines, so Markdown keeps it as one raw HTML block.
    lines = [line.strip() for line in svg.splitlines() if line.strip()]
    return '<div class="graphviz" markdown="0">' + "".join(lines) + "</div>"


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _FENCE.sub(lambda m: _render(m.group(1)), markdown)
