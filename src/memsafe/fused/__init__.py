"""Fused chunk bodies: a split region run as one Pallas kernel that keeps its tiles on chip.

Where a split region's chunk body is a contraction followed by elementwise work and reductions
along the split axis (kernel sums, log-sum-exp rows, max/min, argmin/argmax, online-softmax
attention), :func:`fuse` replaces the chunk loops the split planner chose by one
``jax.experimental.pallas`` kernel: each program of its grid holds a tile of rows and streams the
split axis through an in-kernel loop, folding each tile's partial results with the region's own
reducers. The kernel is generated from the region's equations (:mod:`memsafe.fused.tile`
evaluates them on a tile), not written per program.

The knob is :data:`memsafe.fused.policy.FUSED` (replace it to turn fusion on or off).

Modules, one job each: :mod:`.policy` (the knob: where fusion is on), :mod:`.rows` (the axes a
kernel's grid tiles), :mod:`.tile` (equations at tile shape), :mod:`.reduce` (folding a sink's
tiles, the overlap of a ragged last tile masked), :mod:`.bodies` (one tile of a staged or online
region), :mod:`.kernel` (the ``pallas_call``), :mod:`.split` (the strategy the planner takes).
"""

from memsafe.fused.policy import FusedPolicy
from memsafe.fused.split import FusedSplit, fuse

__all__ = ["FusedPolicy", "FusedSplit", "fuse"]
