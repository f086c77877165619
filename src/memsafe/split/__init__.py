"""Splitting large intermediates into sequential chunks (the pass is memsafe.passes.split).

- ``planner``: which values to split, along which axis, with which strategy and chunk.
- ``program``: the planner run over a whole program, its top level and then its loop bodies.

- ``registry``: the split rule of each primitive (how the axis maps, how it is re-bound), with
  the rules themselves in ``prims/``, one module per family of primitives.
- ``sinks``: reducers, the objects that combine a sink's results across chunks (and devices).
- ``region``: growing the (immutable) region of equations that can run chunk by chunk.
- ``online``: the online-softmax analysis and its single rescaling loop.
- ``size``: the chunk size from the memory budget.
- ``loop``: the one chunk-loop driver, with a pluggable carry.
- ``emit``: staged splits, and the program re-traced with loops as interpreter groups.
"""

from memsafe.split import prims  # noqa: F401 (registers the split rules)
