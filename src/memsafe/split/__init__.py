"""Splitting large intermediates into sequential chunks (the pass is memsafe.passes.split).

The planner, over the core and the strategies:

- ``planner``: which values to split, along which axis, with which strategy and chunk (the
  strategies' lists: ``STRATEGIES``, ``SPANS``, ``LOOPS``, ``RETRIES``, ``REPLACING``).
- ``program``: the planner run over a whole program, its top level and then its loop bodies.

The core, which imports no strategy (tests/test_imports.py):

- ``registry``: the split rule of each primitive (how the axis maps, how it is re-bound), with
  the rules themselves in ``prims/``, one module per family of primitives.
- ``sinks``: reducers, the objects that combine a sink's results across chunks.
- ``region``: growing the (immutable) region of equations that can run chunk by chunk.
- ``span``: what a chunk covers of each value (the plain span; a strategy may bring another).
- ``body``: a loop's or call's body split through the rules.
- ``size``: the chunk size from the memory budget.
- ``loop``: the one chunk-loop driver, with a pluggable carry and runner.
- ``emit``: the ``Split`` protocol, a region's stages as loops, and the program re-traced with
  a split's loops as interpreter groups.

The strategies, one module or folder each, in ``strategies/``: ``staged`` (with ``recompute``),
``online``, ``halo``, ``replay``, ``selection`` and ``sharded``.
"""

from memsafe.split import prims  # noqa: F401 (registers the split rules)
