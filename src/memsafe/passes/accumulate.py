"""Accumulated carries: the linear map a loop's summed carry goes through moves into the loop.

The gradient of a loop that reads a large value in every iteration (a Sinkhorn loop's cost
matrix, the kernel matrix of a conjugate-gradient solve) accumulates that value's cotangent in
the backward loop: a carry as large as the value, ``ct = ct + delta`` in every iteration, from
zeros. After the loop the cotangent goes on through the transpose of the value's computation,
linear in it, to the gradients of much smaller inputs (``x`` and ``y`` of
``sum((x[:, None] - y) ** 2, -1)``). Held whole, that carry stops every split below the value's
size: a carry takes the split axis in but not out.

Where the carry is over a share of the temporaries' budget, this pass moves that linear map
``L`` into the loop body: the loop carries ``L``'s results, small, and adds ``L(delta)`` to them
in every iteration, which is ``L(ct)`` since ``L`` is linear and ``ct`` starts from zeros. Each
iteration's ``delta`` is then made and reduced within the body, which the split pass chunks.
Linearity is :func:`memsafe.split.linear.keeps_sums`' (the same question: which equations keep
a sum a sum). The sum is taken in another order than jax.jit's: its rounding differs as a
chunked sum's does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
from jax import lax

from memsafe._jax import (
    ClosedJaxpr,
    JaxprEqn,
    Var,
    bind_eqn,
    bind_eqn_with,
    eval_jaxpr,
    is_var,
    scan_counts,
    scan_layout,
    source_line,
    with_results,
)
from memsafe.graph import Graph
from memsafe.graph.interpret import Group, retrace
from memsafe.passes.base import PassContext
from memsafe.passes.remat import SHARE_OF_BUDGET
from memsafe.plan import PassRecord, format_bytes
from memsafe.split.linear import Role, is_zero, keeps_sums

#: The map's results, carried instead, must be at most this share of the carry they replace.
MAX_RESULT_SHARE = 0.5


@dataclass(frozen=True)
class Accumulated:
    """A scan's carry summed from zeros, and the linear map its final value goes through.

    Attributes:
        scan: the scan's equation index.
        carry: the carry's position among the scan's carries.
        deltas: the body's values added to the carry in each iteration.
        chain: the top-level equations of the map, in program order.
        results: the map's results read elsewhere (its frontier), carried by the new scan.
        whole: the map's other operands (read whole, made before the scan), new constants.
    """

    scan: int
    carry: int
    deltas: tuple[Var, ...]
    chain: tuple[int, ...]
    results: tuple[Var, ...]
    whole: tuple[Var, ...]


def _deltas(eqn: JaxprEqn, k: int) -> tuple[Var, ...] | None:
    """What the body of scan ``eqn`` adds to carry ``k`` in each iteration (one or more terms,
    ``ct + a + b``), where the carry and its partial sums are read by those sums alone; else
    None."""
    consts = scan_counts(eqn.params)[0]
    body = eqn.params["jaxpr"].jaxpr
    running, out, terms = body.invars[consts + k], body.outvars[k], []
    while running is not out:
        readers = [e for e in body.eqns if running in e.invars]
        if len(readers) != 1 or running in body.outvars:
            return None
        add = readers[0]
        other = [a for a in add.invars if a is not running]
        if add.primitive.name not in ("add", "add_any") or len(other) != 1 or not is_var(other[0]):
            return None
        terms.append(other[0])
        running = add.outvars[0]
    if not terms or set(terms) & set(body.invars[: consts + scan_counts(eqn.params)[1]]):
        return None
    return tuple(terms)


def _linear_map(graph: Graph, s: int, final: Var) -> tuple[tuple[int, ...], set[Var]]:
    """The top-level equations after scan ``s`` linear in its result ``final``, their other
    operands independent of it, and the values they make from it (``final`` included)."""
    shares, tainted, chain = {final}, {final}, []
    for i in range(s + 1, len(graph.eqns)):
        eqn = graph.eqns[i]
        if not any(is_var(a) and a in tainted for a in eqn.invars):
            continue
        roles = [_role(graph, a, shares, tainted) for a in eqn.invars]
        if None not in roles and eqn.params.get("jaxpr") is None and keeps_sums(eqn, roles):
            chain.append(i)
            shares.update(eqn.outvars)
        tainted.update(eqn.outvars)
    return tuple(chain), shares


def _role(graph: Graph, atom: Any, shares: set[Var], tainted: set[Var]) -> Role | None:
    if is_var(atom) and atom in shares:
        return Role.SHARE
    if is_var(atom) and atom in tainted:
        return None  # depends on the carry, not linearly
    return Role.ZERO if is_zero(graph, atom) else Role.WHOLE


def _find(graph: Graph, s: int, k: int, budget: int) -> Accumulated | None:
    """Carry ``k`` of scan ``s`` as an :class:`Accumulated`, where moving its map is worth it."""
    eqn = graph.eqns[s]
    consts = scan_counts(eqn.params)[0]
    final = eqn.outvars[k]
    held = graph.info(final).bytes
    if held <= SHARE_OF_BUDGET * budget or not is_zero(graph, eqn.invars[consts + k]):
        return None
    deltas = _deltas(eqn, k)
    if deltas is None or graph.info(final).is_output:
        return None
    chain, shares = _linear_map(graph, s, final)
    members = set(chain)
    results = tuple(
        v
        for i in chain
        for v in graph.eqns[i].outvars
        if graph.info(v).is_output or any(c not in members for c in graph.info(v).consumers)
    )
    if any(c not in members for c in graph.info(final).consumers) or not results:
        return None
    if sum(graph.info(v).bytes for v in results) > MAX_RESULT_SHARE * held:
        return None
    whole = {
        a: None
        for i in chain
        for a in graph.eqns[i].invars
        if is_var(a) and a not in shares and not is_zero(graph, a)
    }
    made_before = all((graph.info(a).producer or -1) < s for a in whole)
    return Accumulated(s, k, deltas, chain, results, tuple(whole)) if made_before else None


def _step(graph: Graph, acc: Accumulated) -> Callable[..., list[Any]]:
    """The new scan's body: (constants, the map's other operands, the other carries, the map's
    running results, scanned inputs) -> (the other carries, the map's results with this
    iteration's added, scanned outputs)."""
    eqn = graph.eqns[acc.scan]
    consts, carry = scan_counts(eqn.params)
    old = eqn.params["jaxpr"]
    outvars = [acc.deltas[0] if k == acc.carry else v for k, v in enumerate(old.jaxpr.outvars)]
    # the carry's sums dropped (its input is read by nothing); its other terms returned last
    body = with_results(old, [*outvars, *acc.deltas[1:]])
    chain = [graph.eqns[i] for i in acc.chain]
    final, n_w, n_r = eqn.outvars[acc.carry], len(acc.whole), len(acc.results)

    def step(*args: Any) -> list[Any]:
        c, w, rest = args[:consts], args[consts : consts + n_w], list(args[consts + n_w :])
        kept, sums, xs = (
            rest[: carry - 1],
            rest[carry - 1 : carry - 1 + n_r],
            rest[carry - 1 + n_r :],
        )
        outs = eval_jaxpr(body.jaxpr, body.consts, *c, *_with(kept, acc.carry, None), *xs)
        outs, more = outs[: len(old.jaxpr.outvars)], outs[len(old.jaxpr.outvars) :]
        env: dict[Any, Any] = dict(zip(acc.whole, w))
        env[final] = functools.reduce(lax.add, more, outs[acc.carry])
        for e in chain:
            ins = [env[a] if is_var(a) else a.val for a in e.invars]
            env.update(zip(e.outvars, bind_eqn(e, ins)))
        summed = [lax.add(r, env[v]) for r, v in zip(sums, acc.results)]
        return [*_without(outs[:carry], acc.carry), *summed, *outs[carry:]]

    return step


def _rewritten(graph: Graph, acc: Accumulated, invals: list[Any], wholes: list[Any]) -> list[Any]:
    """The scan carrying the map's results in place of the carry: its other results, in their
    order, then the map's results."""
    eqn = graph.eqns[acc.scan]
    consts, carry = scan_counts(eqn.params)
    ins = eqn.params["jaxpr"].jaxpr.invars
    avals = [*ins[:consts], *acc.whole, *_without(ins[consts : consts + carry], acc.carry)]
    avals += [*acc.results, *ins[consts + carry :]]
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in avals]
    new = jax.make_jaxpr(_step(graph, acc))(*shapes)
    zeros = [lax.full(v.aval.shape, 0, v.aval.dtype) for v in acc.results]
    k_in = _without(invals[consts : consts + carry], acc.carry)
    operands = [*invals[:consts], *wholes, *k_in, *zeros, *invals[consts + carry :]]
    n_c, n_r = carry - 1, len(acc.results)
    layout = scan_layout(
        eqn.params, consts + len(wholes), n_c + n_r, len(operands), len(eqn.outvars) - 1 + n_r
    )
    outs = bind_eqn_with(eqn, operands, jaxpr=new, **layout)
    return [*outs[:n_c], *outs[n_c + n_r :], *outs[n_c : n_c + n_r]]


def _with(values: list[Any], k: int, value: Any) -> list[Any]:
    return [*values[:k], value, *values[k:]]


def _without(values: Any, k: int) -> list[Any]:
    return [v for j, v in enumerate(values) if j != k]


def _record(graph: Graph, acc: Accumulated) -> PassRecord:
    final = graph.eqns[acc.scan].outvars[acc.carry]
    held = graph.info(final).bytes
    small = sum(graph.info(v).bytes for v in acc.results)
    return PassRecord(
        "accumulate",
        f"scan: a carry summed from zeros ({format_bytes(held)}) replaced by the results of the "
        f"{len(acc.chain)} linear operations it went through after the loop "
        f"({format_bytes(small)}), summed in every iteration",
        where=source_line(graph.eqns[acc.scan]),
        bytes_saved=held - small,
    )


def _group(graph: Graph, acc: Accumulated) -> Group:
    """The scan and its map as one group of the interpreter: it reads the scan's operands and
    the map's other operands, and gives the scan's other results and the map's results."""
    eqn = graph.eqns[acc.scan]
    operands = tuple(dict.fromkeys(a for a in (*eqn.invars, *acc.whole) if is_var(a)))
    gives = (*_without(eqn.outvars, acc.carry), *acc.results)

    def run(values: list[Any]) -> list[Any]:
        env = dict(zip(operands, values))
        invals = [env[a] if is_var(a) else a.val for a in eqn.invars]
        return _rewritten(graph, acc, invals, [env[v] for v in acc.whole])

    return Group(
        eqns=frozenset({acc.scan, *acc.chain}), needs=operands, gives=gives,
        position=acc.scan, run=run,
    )  # fmt: skip


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Move the linear map of a large accumulated carry of each top-level scan into the scan
    (one carry per scan in one run; maps that share equations: the first)."""
    graph = Graph(closed)
    found: list[Accumulated] = []
    taken: set[int] = set()
    for s, eqn in enumerate(graph.eqns):
        if eqn.primitive.name != "scan" or eqn.params["jaxpr"].jaxpr.effects:
            continue
        for k in range(scan_counts(eqn.params)[1]):
            acc = _find(graph, s, k, ctx.temp_budget)
            if acc is not None and not taken & set(acc.chain):
                found.append(acc)
                taken |= set(acc.chain)
                break
    if not found:
        return closed
    new = retrace(closed, groups=[_group(graph, acc) for acc in found])
    for acc in found:
        ctx.record(_record(graph, acc))
    return new
