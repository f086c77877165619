"""Split rules, one module per family of primitives (importing this package registers them).

To support a new primitive, add a module here (or a line to a family's module) that registers
its :class:`~memsafe.split.registry.SplitRule`, and import it below.
"""

from memsafe.split.prims import (  # noqa: F401 (registration)
    elementwise,
    gather,
    layout,
    linalg,
    random,
    reductions,
    scans,
    stack,
)
