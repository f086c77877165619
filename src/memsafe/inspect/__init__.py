"""See where a JAX program's memory goes: ``memsafe.inspect(f, *args)``.

- :mod:`memsafe.inspect.hlo` parses the optimized HLO text;
- :mod:`memsafe.inspect.graph` builds kernels, arrays and loops from it;
- :mod:`memsafe.inspect.findings` holds the rules of thumb (seed 002) as plain functions;
- :mod:`memsafe.inspect.view` is what findings and renderings read of a report;
- :mod:`memsafe.inspect.render` draws the report as text, Graphviz SVG and HTML.
"""

from memsafe.inspect.findings import FINDINGS, register_finding
from memsafe.inspect.model import Array, Constant, Finding, Kernel, Loop, LoopState
from memsafe.inspect.report import Report, inspect

#: The names before 0.2 (kept for compatibility): the finding checks and their decorator.
RULES = FINDINGS
register = register_finding

__all__ = [
    "FINDINGS",
    "RULES",
    "Array",
    "Constant",
    "Finding",
    "Kernel",
    "Loop",
    "LoopState",
    "Report",
    "inspect",
    "register",
    "register_finding",
]
