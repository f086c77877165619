"""Find independent heavy branches combined by a chain of binary elementwise operations.

XLA may run such branches side by side and keep every branch's result alive until a final fused
combination (seed 002's f_fft_multi: temps grew linearly with the number of FFT chains). This module
only analyses the top-level jaxpr; the schedule pass (``memsafe.passes.schedule``) rewrites what it
finds.

A *chain* is ``e_1 = op_1(a_0, t_1); e_2 = op_2(e_1, t_2); ...; e_m = op_m(e_{m-1}, t_m)`` where
every ``e_j`` (j < m) is used only by ``e_{j+1}`` and has the shape and dtype of ``e_m`` (operand
order may be either way round). The *branch* of a term ``t_j`` is its exclusive cone: the equations
whose results are used, directly or transitively, by ``t_j`` alone.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from memsafe import policy
from memsafe._jax import Var, is_var
from memsafe.graph import Graph
from memsafe.graph.estimate import materialized_values
from memsafe.primitives import FOLDS, FUSIBLE, REDUCTIONS

#: Binary elementwise primitives a chain may be built of (the accumulator on either side).
CHAIN_OPS = FOLDS


@dataclass(frozen=True)
class Step:
    """One chain equation: its index and which operand (0 or 1) is the accumulator."""

    index: int
    acc_pos: int  # -1 for the first equation, whose two operands are both terms


@dataclass(frozen=True)
class Chain:
    """A left fold of binary elementwise ops; ``steps[0]`` combines two terms."""

    steps: tuple[Step, ...]
    first_term: object  # the atom a_0 (the other operand of steps[0])


def is_heavy(graph: Graph, index: int) -> bool:
    """An equation that materializes its result or operands: library calls, loops, dots, large
    reductions, transposes (anything XLA does not fuse into its consumer)."""
    eqn = graph.eqns[index]
    name = eqn.primitive.name
    if name in REDUCTIONS:
        big = sum(graph.info(v).bytes for v in eqn.invars if isinstance(v, Var))
        return big >= policy.REWRITE.heavy_reduction_bytes
    return name not in FUSIBLE


def _same_aval(a: object, b: object) -> bool:
    return tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype  # type: ignore[attr-defined]


def find_chains(graph: Graph) -> list[Chain]:
    """Maximal chains of :data:`CHAIN_OPS` with at least two steps, last equation first."""
    eqns = graph.eqns

    def acc_operand(i: int) -> int | None:
        """Which operand of equation i continues the chain downward (its producer's index)."""
        eqn = eqns[i]
        if eqn.primitive.name not in CHAIN_OPS or len(eqn.invars) != 2:
            return None
        out = eqn.outvars[0]
        for pos in (0, 1):
            v = eqn.invars[pos]
            if not isinstance(v, Var):
                continue
            vi = graph.info(v)
            if vi.producer is None or vi.is_output or vi.consumers != (i,):
                continue
            prod = eqns[vi.producer]
            if prod.primitive.name in CHAIN_OPS and _same_aval(v.aval, out.aval):
                return pos
        return None

    in_chain: set[int] = set()
    chains: list[Chain] = []
    for last in range(len(eqns) - 1, -1, -1):
        if last in in_chain or eqns[last].primitive.name not in CHAIN_OPS:
            continue
        steps: list[Step] = []
        i = last
        while True:
            pos = acc_operand(i)
            if pos is None:
                steps.append(Step(i, -1))
                break
            steps.append(Step(i, pos))
            i = graph.info(eqns[i].invars[pos]).producer  # type: ignore[assignment]
        steps.reverse()
        in_chain.update(s.index for s in steps)
        if len(steps) >= 2:
            first = eqns[steps[0].index]
            chains.append(Chain(tuple(steps), first.invars[0]))
    return chains


def dead_equations(graph: Graph) -> frozenset[int]:
    """Equations without effects whose results reach no program output (e.g. the primal output
    of a VJP program)."""
    eqns = graph.eqns
    needed = {v for v in graph.outputs if isinstance(v, Var)}
    dead: set[int] = set()
    for i in range(len(eqns) - 1, -1, -1):
        eqn = eqns[i]
        if eqn.effects or any(v in needed for v in eqn.outvars):
            needed.update(v for v in eqn.invars if isinstance(v, Var))
        else:
            dead.add(i)
    return frozenset(dead)


def exclusive_cone(
    graph: Graph,
    atom: object,
    stop: frozenset[int] = frozenset(),
    dead: frozenset[int] = frozenset(),
) -> set[int]:
    """Equations whose results feed ``atom`` and nothing else (none of them a program output);
    uses by ``dead`` equations do not count.

    Every output of every cone equation is read only inside the cone, the producer of ``atom``
    included: ``atom`` itself is read only by ``stop`` and its producer's other outputs (a loop's
    other carries, a sort's other operands) by nothing live. Otherwise the cone is empty and the
    term stays where it is: moving a multi-output producer into one branch would hide its other
    outputs from their readers.
    """
    if not is_var(atom):
        return set()
    root = graph.info(atom).producer
    if root is None or graph.info(atom).is_output:
        return set()
    if any(c not in stop and c not in dead for c in graph.info(atom).consumers):
        return set()  # the term is read outside the chain too: it stays where it is
    eqns = graph.eqns
    for v in eqns[root].outvars:
        if v is atom or not isinstance(v, Var):
            continue
        other = graph.info(v)
        if other.is_output or any(c not in dead for c in other.consumers):
            return set()  # the producer's other outputs are read elsewhere
    # An equation joins the cone where its live uses are all in it (and it has one): each
    # joins after every use, so the candidates are the producers of what the cone reads, taken
    # latest first (a use comes after its producer, and joined, or not, before it is taken).
    cone = {root}
    candidates: list[int] = []
    seen: set[int] = set()

    def reads_of(index: int) -> None:
        for v in eqns[index].invars:
            if not isinstance(v, Var):
                continue
            producer = graph.info(v).producer
            if producer is not None and producer not in seen:
                seen.add(producer)
                heapq.heappush(candidates, -producer)

    reads_of(root)
    while candidates:
        q = -heapq.heappop(candidates)
        if q in stop or q in dead:
            continue
        outs = [graph.info(v) for v in eqns[q].outvars if isinstance(v, Var)]
        if not outs or any(vi.is_output for vi in outs):
            continue
        uses = [c for vi in outs for c in vi.consumers if c not in dead]
        if uses and all(c in cone for c in uses):
            cone.add(q)
            reads_of(q)
    return cone


def branch_bytes(graph: Graph, cone: set[int], materialized: frozenset[Var] | None = None) -> int:
    """Estimated bytes a branch holds in buffers of its own (its materialized values)."""
    mat = materialized_values(graph) if materialized is None else materialized
    eqns = graph.eqns
    total = 0
    for i in cone:
        for v in eqns[i].outvars:
            if isinstance(v, Var) and v in mat:
                total += graph.info(v).bytes
    return total
