"""Rematerialization of a scan's residuals: the backward loop recomputes them per iteration.

The gradient of a ``lax.scan`` (flax's ``nn.scan`` over layers, an RNN over time) is a forward
scan that stacks, for every iteration, the values its backward needs (each layer's attention
probabilities: ``float32[layers, batch, heads, L, L]``), and a backward scan that reads them.
Where those stacked residuals are larger than a share of the memory left for temporaries, this
pass makes the forward scan stack only its carry at each iteration (each layer's input
activations) and moves the computation of the residuals into the backward scan's body: the
backward recomputes each iteration's residuals from that iteration's carry, its scanned inputs
and the loop's constants, one iteration at a time. This is ``jax.checkpoint`` around the loop
body, chosen from the limit: one more forward per iteration, for residuals of one iteration
instead of all of them. The split pass can then chunk what is left along the batch.

Where computing the residuals decides on floating-point values (a maximum's gradient records
which operand won; flax's layer norm clamps its variance with a maximum), the forward also
stacks those decisions, and the backward reads them instead of deciding again: recomputed in
another compile, a comparison may see its operands rounded otherwise and break a tie the other
way (fuzz seed 1871 gave 40 NaNs where jax.jit gives 19 when the backward decided again).
Each recomputed residual reaches the backward behind its own ``optimization_barrier``: read from
a stack it was opaque to XLA, which otherwise simplifies across the two (``a * convert(p)`` of a
recomputed decision became ``select(p, a, 0)`` and dropped the NaN of ``inf * 0``, seed 3194).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
from jax import lax

from memsafe import policy
from memsafe._jax import (
    ClosedJaxpr,
    JaxprEqn,
    Var,
    bind_eqn_with,
    eval_jaxpr,
    nbytes_of_aval,
    pruned,
    rewired,
    scan_counts,
    scan_layout,
    source_line,
    with_outputs,
    with_results,
)
from memsafe.context import PassContext
from memsafe.flops import jaxpr_flops
from memsafe.graph import Graph
from memsafe.graph.bodies import any_eqn
from memsafe.graph.graph import memo
from memsafe.graph.interpret import inline_calls, retrace
from memsafe.plan import PassRecord, format_bytes
from memsafe.primitives import compares_floats


@dataclass(frozen=True)
class Pair:
    """A forward scan and the backward scan that alone reads some of its stacked results.

    Attributes:
        forward, backward: the two scans' equation indices.
        residuals: the forward's result positions the backward reads (and nothing else).
        slots: for each residual, its operand position in the backward scan.
        carries: the forward's carry positions the residuals are computed from.
        body: the forward's body with its calls inlined (the decisions below are its values).
        decisions: the values of ``body`` that decide on floating-point values for the
            residuals (the results of comparisons, argmax, sort orders): stacked by the forward
            like its carries and read by the backward instead of deciding again.
        computes: the residuals' computation from the forward's body inputs, then the
            decisions.
    """

    forward: int
    backward: int
    residuals: tuple[int, ...]
    slots: tuple[int, ...]
    carries: tuple[int, ...]
    body: ClosedJaxpr
    decisions: tuple[Var, ...]
    computes: ClosedJaxpr


def _pairs(graph: Graph) -> list[Pair]:
    """Forward scans whose stacked results only a later scan of the same length reads, each
    as one of its scanned operands."""
    eqns, found = graph.eqns, []
    for f, fwd in enumerate(eqns):
        if fwd.primitive.name != "scan" or fwd.params["jaxpr"].jaxpr.effects:
            continue
        by_reader: dict[int, list[tuple[int, int]]] = {}
        for k in range(scan_counts(fwd.params)[1], len(fwd.outvars)):
            slot = _only_scanned_reader(graph, fwd, fwd.outvars[k])
            if slot is not None:
                by_reader.setdefault(slot[0], []).append((k, slot[1]))
        for b, reads in by_reader.items():
            found.append(_pair(fwd, f, b, reads))
    return found


def _pair(fwd: JaxprEqn, f: int, b: int, reads: list[tuple[int, int]]) -> Pair:
    """The pair of scans ``f`` and ``b``, ``reads`` the (residual, slot) it reads."""
    residuals, slots = tuple(k for k, _ in reads), tuple(s for _, s in reads)
    body = inline_calls(fwd.params["jaxpr"])
    whole = with_outputs(body, residuals)
    decisions = tuple(o for e in whole.jaxpr.eqns if compares_floats(e) for o in e.outvars)
    computes = rewired(whole, whole.jaxpr.outvars, decisions)
    return Pair(f, b, residuals, slots, _carries(fwd, computes), body, decisions, computes)


def _only_scanned_reader(graph: Graph, fwd: JaxprEqn, var: Var) -> tuple[int, int] | None:
    """(the scan, operand position) where ``var`` is read only there, scanned; else None."""
    info = graph.info(var)
    if info.is_output or len(info.consumers) != 1:
        return None
    (b,) = info.consumers
    bwd = graph.eqns[b]
    if bwd.primitive.name != "scan" or bwd.params["length"] != fwd.params["length"]:
        return None
    consts, carry = scan_counts(bwd.params)
    slots = [p for p, a in enumerate(bwd.invars) if a is var]
    if len(slots) != 1 or slots[0] < consts + carry:
        return None
    return b, slots[0]


def _carries(fwd: JaxprEqn, computes: ClosedJaxpr) -> tuple[int, ...]:
    """The forward's carry positions the residuals' computation ``computes`` reads."""
    consts, carry = scan_counts(fwd.params)
    _, used = pruned(computes)
    return tuple(k for k in range(carry) if used[consts + k])


def _decides(pair: Pair) -> bool:
    """Whether computing the residuals still decides on floating-point values where the
    forward cannot stack the decisions (inside a loop or a branch of its body)."""
    return any_eqn(pair.computes, compares_floats)


def _held(graph: Graph, pair: Pair) -> int:
    """Bytes of the stacked residuals."""
    fwd = graph.eqns[pair.forward]
    return sum(graph.info(fwd.outvars[k]).bytes for k in pair.residuals)


def _worth_it(graph: Graph, pair: Pair, budget: int) -> bool:
    """Residuals over a share of the budget, and more than twice what replaces them (the
    stacked carries and decisions)."""
    fwd, held = graph.eqns[pair.forward], _held(graph, pair)
    stacked = sum(nbytes_of_aval(v.aval) for v in _stacked(fwd, pair)) * fwd.params["length"]
    return held > policy.REWRITE.share_of_budget * budget and held > 2 * stacked


def _stacked(fwd: JaxprEqn, pair: Pair) -> list[Var]:
    """The body values the forward stacks for the backward: the carries the residuals are
    computed from, then their decisions."""
    consts = scan_counts(fwd.params)[0]
    return [pair.body.jaxpr.invars[consts + k] for k in pair.carries] + list(pair.decisions)


def _forward(fwd: JaxprEqn, invals: list[Any], pair: Pair) -> tuple[list[Any], list[Any]]:
    """The forward scan stacking each iteration's carries and decisions in place of the
    residuals: (its results, with None at the residuals; the stacked values)."""
    consts, carry = scan_counts(fwd.params)
    body = pair.body
    n = len(body.jaxpr.outvars)
    kept = [k for k in range(n) if k not in pair.residuals]
    stacks = _stacked(fwd, pair)
    new = with_results(body, [body.jaxpr.outvars[k] for k in kept] + stacks)
    layout = scan_layout(fwd.params, consts, carry, len(invals), len(kept) + len(stacks))
    outs = bind_eqn_with(fwd, invals, jaxpr=new, **layout)
    results: list[Any] = [None] * n
    for k, v in zip(kept, outs):
        results[k] = v
    return results, list(outs[len(kept) :])


def _backward(
    bwd: JaxprEqn, invals: list[Any], fwd: JaxprEqn, fwd_invals: list[Any], stacked: list[Any],
    pair: Pair,
) -> list[Any]:  # fmt: skip
    """The backward scan recomputing the residuals at each iteration from the forward's
    constants, that iteration's stacked carries and decisions and the forward's scanned inputs
    there."""
    f_consts, f_carry = scan_counts(fwd.params)
    b_consts, b_carry = scan_counts(bwd.params)
    res_body, old = pair.computes, bwd.params["jaxpr"]
    cf = fwd_invals[:f_consts]
    xf = fwd_invals[f_consts + f_carry :]
    own = [p for p in range(b_consts + b_carry, len(invals)) if p not in pair.slots]
    n_cb, n_cf, n_own, n_st = b_consts, len(cf), len(own), len(stacked)
    n_carry = len(pair.carries)

    def body(*args: Any) -> list[Any]:
        cb, cf_, rest = args[:n_cb], args[n_cb : n_cb + n_cf], args[n_cb + n_cf :]
        carry_, rest = rest[:b_carry], rest[b_carry:]
        xs_own, st, xf_ = rest[:n_own], rest[n_own : n_own + n_st], rest[n_own + n_st :]
        carries = [None] * f_carry
        for k, v in zip(pair.carries, st[:n_carry]):
            carries[k] = v
        res = eval_jaxpr(res_body.jaxpr, res_body.consts, *cf_, *carries, *xf_, *st[n_carry:])
        # read from the stacks, the residuals were opaque to XLA; recomputed in the same body,
        # XLA simplifies across: ``a * convert(p)`` of a recomputed decision became
        # ``select(p, a, 0)``, which keeps no NaN from ``inf * 0`` (fuzz seed 3194). One
        # barrier per residual, which the split rules pass chunk by chunk
        res = [lax.optimization_barrier(r) for r in res]
        xs = dict(zip(own, xs_own)) | dict(zip(pair.slots, res))
        ordered = [xs[p] for p in range(b_consts + b_carry, len(invals))]
        return eval_jaxpr(old.jaxpr, old.consts, *cb, *carry_, *ordered)

    operands = [*invals[:b_consts], *cf, *invals[b_consts : b_consts + b_carry]]
    operands += [invals[p] for p in own] + list(stacked) + list(xf)
    fin, bin_ = fwd.params["jaxpr"].jaxpr.invars, old.jaxpr.invars
    avals = [
        *bin_[:b_consts], *fin[:f_consts], *bin_[b_consts : b_consts + b_carry],
        *(bin_[p] for p in own), *_stacked(fwd, pair), *fin[f_consts + f_carry :],
    ]  # fmt: skip
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in avals]
    new = jax.make_jaxpr(body)(*shapes)
    layout = scan_layout(bwd.params, b_consts + n_cf, b_carry, len(operands), len(bwd.outvars))
    return bind_eqn_with(bwd, operands, jaxpr=new, **layout)


def _record(graph: Graph, pair: Pair) -> PassRecord:
    """What the pair's rewrite saves, and the forward work it repeats."""
    fwd, held = graph.eqns[pair.forward], _held(graph, pair)
    flops = jaxpr_flops(pair.computes.jaxpr.eqns) * fwd.params["length"]
    return PassRecord(
        "remat",
        f"scan: {len(pair.residuals)} stacked residual(s) ({format_bytes(held)}) recomputed "
        f"in the backward loop from each iteration's carry, ~{flops:.1e} flops",
        where=source_line(fwd),
        bytes_saved=held,
        data={"recompute_flops": flops},
    )


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Recompute the residuals of every forward/backward scan pair where they are worth it.
    The scan pairs of a program are found once, and its rewrite for a choice of them made once:
    an attempt at another chunk scale that chooses the same pairs reuses it."""
    graph = Graph(closed)
    kept = memo(closed, "remat", valid=policy.REWRITE)
    if "pairs" not in kept:
        kept.update(pairs=_pairs(graph), rewritten={})
    pairs: list[Pair] = kept["pairs"]
    key = tuple(
        n for n, p in enumerate(pairs) if _worth_it(graph, p, ctx.temp_budget) and not _decides(p)
    )
    chosen = [pairs[n] for n in key]
    forwards = {p.forward: p for p in chosen}
    backwards = {p.backward: p for p in chosen}
    if not chosen or len(forwards) != len(chosen) or len(backwards) != len(chosen):
        return closed  # one pair per scan: a scan read by two backward scans is left alone
    for pair in chosen:
        ctx.record(_record(graph, pair))
    if key not in kept["rewritten"]:
        kept["rewritten"][key] = _rewritten(closed, graph, forwards, backwards)
    return kept["rewritten"][key]


def _rewritten(
    closed: ClosedJaxpr, graph: Graph, forwards: dict[int, Pair], backwards: dict[int, Pair]
) -> ClosedJaxpr:
    """``closed`` with each pair's forward stacking its carries and its backward recomputing
    the residuals from them."""
    seen: dict[int, tuple[list[Any], list[Any]]] = {}

    def override(i: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        if i in forwards:
            results, stacked = _forward(eqn, invals, forwards[i])
            seen[i] = (invals, stacked)
            return results
        if i in backwards:
            pair = backwards[i]
            fwd_invals, stacked = seen[pair.forward]
            fwd = graph.eqns[pair.forward]
            return _backward(eqn, invals, fwd, fwd_invals, stacked, pair)
        return None

    return retrace(closed, override)
