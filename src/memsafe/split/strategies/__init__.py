"""Split strategies: the ways a region may run besides the core's chunk loop, one module each.

The split core (``memsafe.split``: the region, the rule registry and ``prims/``, reducers, the
chunk loop and its environment, spans, the size model, the ``Split`` protocol of ``emit``)
imports nothing from here; the planner (``memsafe.split.planner``) lists the strategies in its
tables, and each strategy reaches the core through the protocols it implements.

- ``staged``: one loop per stage (every region runs so unless another strategy applies), and
  ``recompute``, what its later loops recompute and how they compare recomputed values alike.
- ``online``: staged max-shifted exp-sums (softmax, log-sum-exp) as one loop that rescales its
  accumulators (``planner.STRATEGIES``).
- ``halo``: several windowed operations in a row on extended chunks (a ``Spanning``,
  ``planner.SPANS``).
- ``replay``: loops that only accumulate into a carry, replayed per chunk of it (a retry,
  ``planner.RETRIES``).
- ``selection``: a loop whose only work is a ``top_k`` along the axis, run in tiles (a loop
  strategy, ``planner.LOOPS``).
- ``sharded``: the split axis sharded over the devices of a mesh (the planner's ``mesh=``).
"""
