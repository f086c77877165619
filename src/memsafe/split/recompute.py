"""What a staged split costs in recomputation: each loop beyond the first re-evaluates, chunk by
chunk, the equations of earlier stages it reads (the region's shared prefix), since only sink
results and surviving values leave a loop.

An online split (memsafe.split.online) runs its stages as one loop with running rescaling and
recomputes nothing; a split sharded over a mesh costs what the split it wraps costs.
"""

from __future__ import annotations

from typing import Any

from memsafe.flops import jaxpr_flops
from memsafe.graph import Graph
from memsafe.split.emit import StagedSplit, plan_loops


def _unwrapped(split: Any) -> Any:
    """The split a mesh wrapper (``.inner``) shards, or ``split`` itself."""
    while hasattr(split, "inner"):
        split = split.inner
    return split


def cost(graph: Graph, split: Any) -> dict[str, int]:
    """``stages`` (the loops ``split`` runs) and ``recompute_flops`` (the estimated flops its
    later loops spend re-evaluating equations of earlier stages), as keyword arguments of
    :class:`memsafe.plan.SplitRecord`."""
    split = _unwrapped(split)
    if not isinstance(split, StagedSplit):
        return {"stages": 1, "recompute_flops": 0}
    region, eqns = split.region, graph.eqns
    loops = plan_loops(graph, region)
    again = [eqns[i] for lp in loops for i in lp.eqns if region.stage[i] < lp.stage]
    return {"stages": len(loops), "recompute_flops": jaxpr_flops(again)}
