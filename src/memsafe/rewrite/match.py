"""Match-and-replace: rewrite expressions that have a cheaper equivalent (memsafe.rules).

The match-and-replace pass (:mod:`memsafe.passes.match_replace`) and ``rewritten``
(:mod:`memsafe.rewrite.algebraic`) run :func:`apply_rules`.

Rules are tried at every value, latest first, larger patterns before smaller; a match claims its
region so matches never overlap. The program is re-traced with the replacements (which keep the
user's source line) and dead code is dropped; this repeats until no rule fires.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax

from memsafe import policy
from memsafe._jax import ClosedJaxpr, Var, dce, eqn_context, make_closed_jaxpr, source_line
from memsafe.graph import Graph, evaluate
from memsafe.plan import RuleRecord
from memsafe.rules.cost import savings
from memsafe.rules.ir import IR
from memsafe.rules.pattern import Match, Rule, Variant, program_edges


def _variants_by_op(
    rules: Sequence[Rule],
    ops: set[str],
    ends: set[tuple[str, int]],
    edges: set[tuple[str, str]] | None = None,
) -> dict[str, list[Variant]]:
    """The variants of ``rules`` that can match in a program with the operations ``ops`` (and
    the (operation, operand's operation) pairs ``edges``) at values of the (operation, rank)
    pairs ``ends``, by their root's operation, largest first (then in the rules' order)."""
    ranks = {rank for _, rank in ends}
    ordered: list[tuple[int, int, Variant]] = []
    for r, rule in enumerate(rules):
        for variant in rule.variants_for(ops, ranks, ends, edges):
            ordered.append((-variant.size, r, variant))
    ordered.sort(key=lambda t: (t[0], t[1]))
    by_op: dict[str, list[Variant]] = {}
    for _, _, variant in ordered:
        by_op.setdefault(variant.root.node.op, []).append(variant)
    return by_op


def find_matches(
    closed: ClosedJaxpr, rules: Sequence[Rule], measure: bool = True
) -> list[tuple[Match, RuleRecord]]:
    """Non-overlapping matches of ``rules`` in ``closed`` that are allowed to fire.

    ``measure``: compile each match's pattern and replacement to record the bytes and flops it
    saves (always done for rules with ``min_bytes_saved``, which need it to decide)."""
    graph = Graph(closed)
    ir = IR(closed).build_all()
    roots = [
        eqn.outvars[0]
        for eqn in graph.eqns
        if len(eqn.outvars) == 1
        and isinstance(eqn.outvars[0], Var)
        and hasattr(eqn.outvars[0].aval, "shape")
    ]
    ends = {(ir.view(v).node.op, ir.view(v).rank) for v in roots}
    by_op = _variants_by_op(rules, {node.op for node in ir.nodes}, ends, program_edges(ir))
    claimed: set[int] = set()
    found: list[tuple[Match, RuleRecord]] = []
    eqns = graph.eqns
    for index in reversed(range(len(eqns))):
        eqn = eqns[index]
        if index in claimed or len(eqn.outvars) != 1 or not isinstance(eqn.outvars[0], Var):
            continue
        var = eqn.outvars[0]
        if not hasattr(var.aval, "shape"):
            continue
        op = ir.view(var).node.op
        for variant in by_op.get(op, ()):
            match = variant.match(ir, graph, var)
            if match is None or match.region & claimed:
                continue
            rule = variant.rule
            where = _where(eqns, index, match.region)
            record = _record(match, where, measure or rule.min_bytes_saved is not None)
            if rule.min_bytes_saved is not None and record.bytes_saved < rule.min_bytes_saved:
                continue
            claimed |= match.region
            found.append((match, record))
            break
    return found


def _where(eqns: Sequence[Any], root: int, region: Collection[int]) -> str:
    """The user's source line of a match: its root's, else the latest matched equation's that
    has one (a root inside a library function, the ``sqrt`` of ``jnp.linalg.norm``, has none)."""
    for index in (root, *sorted(region, reverse=True)):
        where = source_line(eqns[index])
        if where:
            return where
    return ""


def _record(match: Match, where: str, measure: bool) -> RuleRecord:
    variant = match.variant
    saved_bytes, saved_flops = 0, 0.0
    try:
        if measure:
            saved_bytes, saved_flops = savings(variant.pattern, variant.replacement, match.avals)
    except Exception:  # measuring is advisory; a failed compile must not block the rewrite
        pass
    sizes = ", ".join(f"{k}={v}" for k, v in match.sizes.items() if not k.startswith("__"))
    shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in match.avals)
    detail = f"{variant.label}; inputs {shapes}" + (f" ({sizes})" if sizes else "")
    return RuleRecord(
        rule=variant.rule.name,
        where=where,
        bytes_saved=int(saved_bytes),
        flops_saved=int(saved_flops),
        detail=detail,
    )


def apply_matches(
    closed: ClosedJaxpr, matches: Sequence[Match], rewrites: Sequence[Any] = ()
) -> ClosedJaxpr:
    """Re-trace ``closed`` with each match's root computed by its replacement (and each
    procedural rewrite's root by its ``compute``)."""
    at: dict[int, Callable[[Callable[[Any], Any]], Any]] = {}
    for m in matches:
        at[m.root_index] = functools.partial(_replace, m)
    for r in rewrites:
        at[r.root_index] = r.compute
        at.update(r.more)
    env: dict[Any, Any] = {}

    def override(index: int, eqn: Any, invals: list[Any]) -> list[Any] | None:
        compute = at.get(index)
        if compute is None:
            return None
        with eqn_context(eqn):
            out = compute(env.__getitem__)
        return out if isinstance(out, list) else [out]

    def program(*xs: Any) -> list[Any]:
        env.clear()
        return evaluate(closed, xs, override, env)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    new, _ = make_closed_jaxpr(program, avals)
    return dce(new)


def _replace(match: Match, read: Callable[[Any], Any]) -> Any:
    return match.variant.replacement(*match.arguments(read))


def apply_rules(
    closed: ClosedJaxpr,
    rules: Sequence[Rule],
    measure: bool = True,
    rewrites: Sequence[Callable[[ClosedJaxpr], list[Any]]] = (),
) -> tuple[ClosedJaxpr, list[RuleRecord]]:
    """Apply ``rules`` (and procedural ``rewrites``) until none fires; returns the program and
    a record per rewrite."""
    records: list[RuleRecord] = []
    for _ in range(policy.REWRITE.max_match_rounds):
        found = find_matches(closed, rules, measure)
        claimed: set[int] = set()
        for m, _ in found:
            claimed |= m.region
        procedural = []
        for finder in rewrites:
            for r in finder(closed):
                if not (r.region & claimed):
                    claimed |= r.region
                    procedural.append(r)
        if not found and not procedural:
            break
        closed = apply_matches(closed, [m for m, _ in found], procedural)
        records.extend(r for _, r in found)
        records.extend(r.record for r in procedural)
    return closed, records
