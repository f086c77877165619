"""What a staged split costs in recomputation: each loop beyond the first re-evaluates, chunk by
chunk, the equations of earlier stages it reads (the region's shared prefix), since only sink
results and surviving values leave a loop.

An online split (memsafe.split.strategies.online) runs its stages as one loop with running rescaling
and recomputes nothing; a split sharded over a mesh costs what the split it wraps costs.

A later loop that compares recomputed values with what an earlier loop found (the gradient of
``max`` compares each value with the maximum) needs each value with the bits the earlier loop
had (:func:`decides_on_recomputed`). The loops recompute the same equations on the same chunks;
what could change the bits is computing them otherwise in one loop: a peephole move, or a split
of one loop's body (fuzz seed 716: the second loop's body, split again along a contraction,
summed in another order and found no value equal to the minimum the first loop had found; 0/0
followed; a product split by rows may round otherwise too, as XLA blocks it otherwise). Such a
split runs every loop without peepholes, and the split pass does not split its loops' bodies.
"""

from __future__ import annotations

from typing import Any

from memsafe._jax import LOOP_BODIES, is_var, programs
from memsafe.flops import jaxpr_flops
from memsafe.graph import Graph
from memsafe.graph.bodies import any_eqn
from memsafe.primitives import compares_floats
from memsafe.split.emit import plan_loops, unwrapped
from memsafe.split.region import Region
from memsafe.split.strategies.staged import StagedSplit


def cost(graph: Graph, split: Any, chunk: int = 0) -> dict[str, int]:
    """``stages`` (the loops ``split`` runs), ``recompute_flops`` (the estimated flops its
    later loops spend re-evaluating equations of earlier stages, and, on extended chunks of
    ``chunk`` (:mod:`memsafe.split.strategies.halo`), every loop computing its halos) and
    ``extend``, as keyword arguments of :class:`memsafe.plan.SplitRecord`."""
    split = unwrapped(split)
    if not isinstance(split, StagedSplit):
        return {"stages": 1, "recompute_flops": 0, "extend": 0}
    region, eqns = split.region, graph.eqns
    loops = plan_loops(graph, region)
    again = [eqns[i] for lp in loops for i in lp.eqns if region.stage[i] < lp.stage]
    flops = jaxpr_flops(again)
    extend = region.span.extend
    if extend and chunk:  # 2E more positions per chunk, in every loop
        every = jaxpr_flops(eqns[i] for lp in loops for i in lp.eqns)
        flops += every * 2 * extend * -(-region.size // chunk) // region.size
    return {"stages": len(loops), "recompute_flops": flops, "extend": extend}


def decides_on_recomputed(graph: Graph, region: Region) -> bool:
    """Whether a loop of ``region`` run in stages recomputes equations of an earlier stage and
    compares floating-point values (in its own equations or the loops and branches they run)."""
    eqns = graph.eqns
    return any(
        any(region.stage[i] < lp.stage for i in lp.eqns)
        and any(_compares(eqns[i]) for i in lp.eqns)
        for lp in plan_loops(graph, region)
    )


def pinned(graph: Graph, region: Region) -> frozenset[int]:
    """Equations of ``region`` that several of its loops evaluate and that a comparison of the
    region depends on (in its own equation or in a loop or branch it runs):
    :meth:`memsafe.split.loop.ChunkEnv.pinned` holds their floating-point results behind a
    barrier in every loop, so each is compiled alone, and the value a later loop compares is
    the one an earlier loop reduced.

    XLA compiles each loop body on its own, and fused and simplified the chain ``tanh(h) * mask
    / 0.9 * gate`` otherwise where it fed the loop finding the maxima than where it fed the
    comparison with them (a graph network's gradient of ``segment_max``, 37% off); pinning the
    compared value alone left its chain free to round otherwise. What follows the comparisons
    is left to XLA, which makes there the simplifications jax.jit makes (it turns ``a *
    convert(p)`` of a decision ``p`` into a select: ``inf * False`` is 0 there, not NaN)."""
    eqns = graph.eqns
    again = {i for lp in plan_loops(graph, region) for i in lp.eqns if region.stage[i] < lp.stage}
    compared = [
        p
        for j in region.maps
        if _compares(eqns[j])
        for a in eqns[j].invars
        if is_var(a) and a in region.produced
        if (p := graph.info(a).producer) is not None and p in region.maps
    ]
    return frozenset(again & region.ancestors(graph, compared))


def _compares(eqn: Any) -> bool:
    inner = programs(eqn) if eqn.primitive.name in LOOP_BODIES else ()
    return compares_floats(eqn) or any(any_eqn(b, compares_floats) for b in inner)
