"""Splitting large intermediates into sequential chunks (the pass is memsafe.passes.split).

- ``axis_rules``: how a split axis maps through each primitive and how to re-bind it at chunk shape.
- ``region``: growing the region of equations that can run chunk by chunk, and its stages.
- ``sinks``: how reductions, argmax/argmin, contractions and top_k combine across chunks.
- ``size``: the chunk size from the memory budget.
- ``emit``: the loops, and the program re-traced around them.
"""

from memsafe.split import prims  # noqa: F401 (registers the split rules)
