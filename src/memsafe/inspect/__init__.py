"""See where a JAX program's memory goes: ``memsafe.inspect(f, *args)``.

- :mod:`memsafe.inspect.hlo` parses the optimized HLO text;
- :mod:`memsafe.inspect.graph` builds kernels, arrays and loops from it;
- :mod:`memsafe.inspect.findings` holds the rules of thumb (seed 002) as plain functions;
- :mod:`memsafe.inspect.render` draws the report as text, Graphviz SVG and HTML.
"""

from memsafe.inspect.findings import RULES, register
from memsafe.inspect.model import Array, Constant, Finding, Kernel, Loop, LoopState
from memsafe.inspect.report import Report, inspect

__all__ = [
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
]
