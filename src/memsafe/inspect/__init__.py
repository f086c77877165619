"""See where a JAX program's memory goes: ``memsafe.inspect(f, *args)``.

- :mod:`memsafe.inspect.hlo` parses the optimized HLO text;
- :mod:`memsafe.inspect.graph` builds kernels, arrays and loops from it;
- :mod:`memsafe.inspect.findings` holds the rules of thumb (seed 002) as plain functions;
  :mod:`memsafe.inspect.findings_split` the one pointing to ``memsafe.jit`` (imported here so
  that it is registered);
- :mod:`memsafe.inspect.buffers` and :mod:`memsafe.inspect.timeline` read XLA's buffer
  assignment into the memory timeline, :mod:`memsafe.inspect.timeline_render` draws it;
- :mod:`memsafe.inspect.view` is what findings and renderings read of a report;
- :mod:`memsafe.inspect.render` draws the report as text, Graphviz SVG and HTML.
"""

from memsafe.inspect import findings_split  # noqa: F401 (registers its finding)
from memsafe.inspect.findings import FINDINGS, register_finding
from memsafe.inspect.model import Array, Constant, Finding, Kernel, Loop, LoopState
from memsafe.inspect.report import Report, inspect
from memsafe.inspect.timeline import Timeline

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
    "Timeline",
    "inspect",
    "register",
    "register_finding",
]
