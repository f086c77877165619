"""Loop invariants recomputed inside the loops that read them, instead of held for the whole loop.

:func:`transform` finds the constants of ``scan`` loops (and, where asked, ``while`` loops and the
operands of ``cond``s) that cheap generators compute (:func:`generator`) and moves their
computation into the loop bodies (the branches that read them), recursively; :class:`Moving`
says which constants move. The recompute pass (:mod:`memsafe.passes.recompute`) runs it with the
defaults, the constants pass on the generators it puts in place of constants, and the split
planner (:mod:`memsafe.split.program`) on invariants too large to hold beside a split body.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import Any

import jax
from jax import lax

from memsafe import policy
from memsafe._jax import (
    CALL_PRIMITIVES,
    CUSTOM_DIFF_PRIMITIVES,
    ClosedJaxpr,
    JaxprEqn,
    Literal,
    Var,
    bind_eqn_with,
    closure_hoisted,
    scan_counts,
    source_line,
)
from memsafe.graph import Graph, evaluate, evaluate_eqns, inline_calls, retrace
from memsafe.plan import PassRecord
from memsafe.primitives import CONTROL, FUSIBLE, LOOPS, REDUCTIONS, STREAMED

#: Primitives recomputed inside every loop iteration: those XLA fuses into their consumer (not
#: :data:`memsafe.primitives.CHEAP`, which says what a split region recomputes per chunk).
IN_LOOP = FUSIBLE

#: Which loops a transform leaves alone.
Skip = Callable[[JaxprEqn], bool]
#: Whether the constant at an operand position of a loop may move into its body.
Takes = Callable[[JaxprEqn, int], bool]

#: Primitives a value that cannot be held at all may be recomputed with per iteration, besides
#: :data:`IN_LOOP`: reductions and matrix products (a distance matrix ``sum((x[:, None] - y) ** 2,
#: -1)`` or ``x @ y.T`` read by every iteration of a Sinkhorn loop). KeOps and geomloss recompute
#: such a matrix in every iteration; holding it is what does not fit. Transposes too (the
#: table's streamed primitives, :data:`IN_LOOP` and transposes): the gradient of a solve with a
#: matrix that is not symmetric solves with its transpose (lineax's GMRES). A union of the
#: table's live sets: it follows ``memsafe.primitives.declare``.
UNHELD = STREAMED | REDUCTIONS | {"dot_general"}


def _never(eqn: JaxprEqn) -> bool:
    return False


def _any(eqn: JaxprEqn, position: int) -> bool:
    return True


@dataclass(frozen=True)
class Moving:
    """Which loop constants a transform recomputes inside the loops that read them.

    Attributes:
        min_bytes: constants smaller than this stay where they are (None:
            ``policy.REWRITE.invariant_min_bytes``).
        ops: the primitives a constant's computation may use (:data:`IN_LOOP` by default).
        skip: loops to leave as they are.
        takes: which constants of the other loops may move, by operand position.
        whiles: whether the constants of ``while`` loops move too (:func:`loop_const_positions`).
        conds: whether the operands of ``cond``s move too, into the branches that read them (a
            large value a branch reduces, made from small ones: split inside the branch, it is
            never whole).
    """

    min_bytes: int | None = None
    ops: Set[str] = IN_LOOP
    skip: Skip = _never
    takes: Takes = _any
    whiles: bool = False
    conds: bool = False

    @property
    def floor(self) -> int:
        """Bytes from which a constant moves."""
        return policy.REWRITE.invariant_min_bytes if self.min_bytes is None else self.min_bytes


_DEAD = object()  # placeholder for values no longer computed at this level


@dataclass(frozen=True)
class Generator:
    """How to recompute one loop constant: equations (program order) and the values they read."""

    var: Var
    eqns: tuple[int, ...]
    leaves: tuple[Var, ...]


def loop_const_positions(eqn: JaxprEqn, whiles: bool = False, conds: bool = False) -> list[int]:
    """Operand positions of a loop equation whose constants are worth moving into its body.

    ``scan`` (fori_loop with static bounds, lax.scan); ``while`` only where ``whiles``: in a
    ``while`` loop XLA's while-loop-invariant-code-motion hoists the recomputation straight back
    out (measured on CPU: a k-mesh written by hand inside a while_loop body still costs the full
    temporary), unless the body is split afterwards, the recomputation then sitting inside its
    chunk loops. ``while`` bodies are still searched for inner scans. ``cond`` only where
    ``conds``: every operand but the branch index (each branch recomputes the value, once per
    time it runs, only where it reads it).
    """
    if eqn.primitive.name == "cond" and conds:
        return list(range(1, len(eqn.invars)))
    if eqn.primitive.name == "scan":
        return list(range(scan_counts(eqn.params)[0]))
    if eqn.primitive.name == "while" and whiles:
        return list(range(eqn.params["cond_nconsts"] + eqn.params["body_nconsts"]))
    return []


def generator(graph: Graph, var: Any, ops: Set[str] = IN_LOOP) -> Generator | None:
    """The computation of ``var`` by primitives in ``ops`` back to small, literal or always-live
    leaves, or None."""
    if not isinstance(var, Var) or graph.info(var).producer is None:
        return None
    eqns = graph.eqns
    cone: set[int] = set()
    leaves: list[Var] = []
    stack = [var]
    seen: set[Var] = set()
    while stack:
        v = stack.pop()
        if isinstance(v, Literal) or v in seen:
            continue
        seen.add(v)
        vi = graph.info(v)
        if vi.producer is None:  # program argument or constant: live for the whole program
            leaves.append(v)
            continue
        eqn = eqns[vi.producer]
        name = eqn.primitive.name
        # A small value a reduction or product made is read, not recomputed: the row sums of a
        # matrix the loop reads, made per iteration, would need the whole matrix each time.
        recomputed = name in IN_LOOP or vi.bytes > policy.REWRITE.small_leaf_bytes
        if name in ops and recomputed and not eqn.effects:
            cone.add(vi.producer)
            if len(cone) > policy.REWRITE.max_cone:
                return None
            stack.extend(a for a in eqn.invars if isinstance(a, Var))
        elif vi.bytes <= policy.REWRITE.small_leaf_bytes:
            leaves.append(v)
        else:
            return None  # would keep a large intermediate alive instead
    if not cone:
        return None
    return Generator(var, tuple(sorted(cone)), tuple(leaves))


def _regenerate(eqns: Sequence[JaxprEqn], gen: Generator, leaf_vals: Sequence[Any]) -> Any:
    return evaluate_eqns(eqns, gen.eqns, dict(zip(gen.leaves, leaf_vals)))[gen.var]


def _body_jaxprs(eqn: JaxprEqn) -> dict[Any, ClosedJaxpr]:
    """The programs of a loop (or cond: ``branches`` at position k is ``("branches", k)``)."""
    name = eqn.primitive.name
    if name == "cond":
        return {("branches", k): b for k, b in enumerate(eqn.params["branches"])}
    if name == "scan":
        return {"jaxpr": eqn.params["jaxpr"]}
    if name == "while":
        return {"cond_jaxpr": eqn.params["cond_jaxpr"], "body_jaxpr": eqn.params["body_jaxpr"]}
    return {}


def _process_body(
    body: ClosedJaxpr, records: list[PassRecord], depth: int, moving: Moving
) -> ClosedJaxpr:
    """``body`` transformed (with nested calls inlined first), or ``body`` itself if unchanged."""
    names = {e.primitive.name for e in body.jaxpr.eqns}
    flat = inline_calls(body) if names & (CALL_PRIMITIVES | CUSTOM_DIFF_PRIMITIVES) else body
    new = transform(flat, records, depth + 1, moving)
    return body if new is flat else new


def _as_fun(closed: ClosedJaxpr):
    return lambda *args: evaluate(closed, args)


def _reads(closed: ClosedJaxpr, position: int) -> bool:
    """Whether ``closed`` reads its input at ``position``."""
    var = closed.jaxpr.invars[position]
    used = (a for e in closed.jaxpr.eqns for a in e.invars)
    return any(a is var for a in (*used, *closed.jaxpr.outvars))


def _rebind_cond(
    eqn: JaxprEqn, invals: list[Any], bodies: dict[Any, ClosedJaxpr], moved: dict[int, Any]
) -> list[Any]:
    """A ``cond`` bound again as ``lax.switch`` on its (whole) index, each branch with its new
    program and the operands at positions ``moved`` recomputed inside it where it reads them
    (a branch that does not gets None in their place: it never reads it)."""
    branches = [bodies[("branches", k)] for k in range(len(eqn.params["branches"]))]

    def branch(closed: ClosedJaxpr) -> Callable[..., list[Any]]:
        def run(*ops: Any) -> list[Any]:
            made = {k: moved[k]() for k in moved if _reads(closed, k - 1)}
            args = [made.get(k, None if k in moved else op) for k, op in enumerate(ops, 1)]
            return evaluate(closed, args)

        return run

    ops = [None if k in moved else v for k, v in enumerate(invals[1:], 1)]
    return list(lax.switch(invals[0], [branch(b) for b in branches], *ops))


def _rebind_loop(
    eqn: JaxprEqn,
    invals: list[Any],
    bodies: dict[Any, ClosedJaxpr],
    moved: dict[int, Any],
) -> list[Any]:
    """Bind ``eqn`` again through the public loop API, with new bodies and the constants at
    positions ``moved`` recomputed inside the body by the given thunks."""
    name = eqn.primitive.name
    p = eqn.params
    if name == "cond":
        return _rebind_cond(eqn, invals, bodies, moved)
    if name == "scan":
        nc, ncarry = scan_counts(p)
        consts, init, xs = invals[:nc], invals[nc : nc + ncarry], invals[nc + ncarry :]
        body = _as_fun(bodies["jaxpr"])

        def step(carry: list[Any], x: list[Any]) -> tuple[list[Any], list[Any]]:
            cs = [moved[k]() if k in moved else c for k, c in enumerate(consts)]
            outs = body(*cs, *carry, *x)
            return list(outs[:ncarry]), list(outs[ncarry:])

        carry, ys = lax.scan(
            step, list(init), list(xs), length=p["length"], reverse=p["reverse"],
            unroll=p["unroll"],
        )  # fmt: skip
        return [*carry, *ys]
    ncc, nbc = p["cond_nconsts"], p["body_nconsts"]
    cconsts, bconsts, init = invals[:ncc], invals[ncc : ncc + nbc], invals[ncc + nbc :]
    cond, body = _as_fun(bodies["cond_jaxpr"]), _as_fun(bodies["body_jaxpr"])

    def cond_fun(carry: list[Any]) -> Any:
        cs = [moved[k]() if k in moved else c for k, c in enumerate(cconsts)]
        return cond(*cs, *carry)[0]

    def body_fun(carry: list[Any]) -> list[Any]:
        bs = [moved[ncc + k]() if ncc + k in moved else c for k, c in enumerate(bconsts)]
        return list(body(*bs, *carry))

    if bodies["cond_jaxpr"].out_avals[0].shape:
        return _bind_batched_while(eqn, init, cond_fun, body_fun)
    return list(lax.while_loop(cond_fun, body_fun, list(init)))


def _bind_batched_while(
    eqn: JaxprEqn,
    init: Sequence[Any],
    cond_fun: Callable[[list[Any]], Any],
    body_fun: Callable[[list[Any]], list[Any]],
) -> list[Any]:
    """``eqn``, a while loop whose predicate is batched (the form ``jax.vmap`` of a loop with a
    per-position predicate takes: it runs while any position's predicate holds, and a position
    whose predicate is false keeps its carries), bound again with the new ``cond_fun`` and
    ``body_fun`` as the same primitive: ``lax.while_loop`` takes scalar predicates only. What
    the functions close over (the values a moved constant is recomputed from) becomes the
    loop's constants, as ``lax.while_loop`` makes them."""
    avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in eqn.outvars
    ]
    cond, cond_consts = closure_hoisted(lambda *carry: [cond_fun(list(carry))], avals)
    body, body_consts = closure_hoisted(lambda *carry: body_fun(list(carry)), avals)
    return bind_eqn_with(
        eqn,
        [*cond_consts, *body_consts, *init],
        cond_jaxpr=cond,
        body_jaxpr=body,
        cond_nconsts=len(cond_consts),
        body_nconsts=len(body_consts),
    )


def _dead_after(graph: Graph, removed_uses: set[tuple[int, int]], keep: set[Var]) -> set[int]:
    """Equations whose results are no longer needed once the (eqn, operand) uses are dropped
    (values in ``keep`` stay needed)."""
    eqns = graph.eqns
    needed = {v for v in graph.outputs if isinstance(v, Var)} | keep
    dead: set[int] = set()
    for i in range(len(eqns) - 1, -1, -1):
        eqn = eqns[i]
        if eqn.effects or any(v in needed for v in eqn.outvars):
            for pos, v in enumerate(eqn.invars):
                if isinstance(v, Var) and (i, pos) not in removed_uses:
                    needed.add(v)
        else:
            dead.add(i)
    return dead


#: A loop's new bodies (by parameter name) and the generators of the constants moving into it
#: (by operand position).
LoopPlan = tuple[dict[Any, ClosedJaxpr], dict[int, Generator]]


def _plan_loop(
    graph: Graph, eqn: JaxprEqn, records: list[PassRecord], depth: int, moving: Moving
) -> LoopPlan | None:
    """The plan of loop ``eqn``: its bodies transformed (their moves recorded first), and the
    generators of its constants ``moving`` selects, each recorded; None where neither changes."""
    positions = loop_const_positions(eqn, moving.whiles, moving.conds)
    bodies = {k: _process_body(b, records, depth, moving) for k, b in _body_jaxprs(eqn).items()}
    changed = any(bodies[k] is not b for k, b in _body_jaxprs(eqn).items())
    gens: dict[int, Generator] = {}
    for pos in positions:
        var = eqn.invars[pos]
        if not isinstance(var, Var) or graph.info(var).bytes < moving.floor:
            continue
        if not moving.takes(eqn, pos):
            continue
        gen = generator(graph, var, moving.ops)
        if gen is not None:
            gens[pos] = gen
    if not (gens or changed):
        return None
    records.extend(_record(graph, eqn, gen, depth) for gen in gens.values())
    return bodies, gens


def _record(graph: Graph, eqn: JaxprEqn, gen: Generator, depth: int) -> PassRecord:
    """What the plan says of ``gen``'s value, recomputed inside loop ``eqn`` at ``depth``."""
    eqns = graph.eqns
    prims = sorted({eqns[j].primitive.name for j in gen.eqns})
    nbytes = graph.info(gen.var).bytes
    return PassRecord(
        "recompute",
        f"recomputed a loop-invariant {gen.var.aval.str_short()} "
        f"({nbytes} B) inside the {eqn.primitive.name} body instead of holding "
        f"it for the whole loop ({len(gen.eqns)} ops: {', '.join(prims)})",
        where=source_line(eqns[gen.eqns[-1]]),
        bytes_saved=nbytes,
        data={"loop": eqn.primitive.name, "ops": prims, "depth": depth},
    )


def transform(
    closed: ClosedJaxpr,
    records: list[PassRecord],
    depth: int = 0,
    moving: Moving = Moving(),
) -> ClosedJaxpr:
    """Move the loop constants ``moving`` selects into loop bodies in ``closed`` and,
    recursively, its loops.

    Args:
        closed: the program.
        records: where each move is recorded (inner loops' first).
        depth: how many loops ``closed`` runs in (recorded).
        moving: which constants move.

    Returns:
        The new program, or ``closed`` itself where nothing moves.
    """
    graph = Graph(closed)
    eqns = graph.eqns
    plans: dict[int, LoopPlan] = {}
    removed: set[tuple[int, int]] = set()
    for i, eqn in enumerate(eqns):
        loops = CONTROL if moving.conds else LOOPS
        if eqn.primitive.name not in loops or moving.skip(eqn):
            continue
        plan = _plan_loop(graph, eqn, records, depth, moving)
        if plan is not None:
            plans[i] = plan
            removed |= {(i, pos) for pos in plan[1]}
    if not plans:
        return closed
    leaves = {v for _, gens in plans.values() for g in gens.values() for v in g.leaves}
    dead = _dead_after(graph, removed, leaves)
    env: dict[Any, Any] = {}  # the traced values (retrace fills it)

    def override(index: int, eqn: JaxprEqn, invals: list[Any]) -> Sequence[Any] | None:
        if index in dead:
            return [_DEAD] * len(eqn.outvars)
        if index not in plans:
            return None
        bodies, gens = plans[index]
        moved = {
            pos: (lambda g=gen: _regenerate(eqns, g, [env[v] for v in g.leaves]))
            for pos, gen in gens.items()
        }
        return _rebind_loop(eqn, invals, bodies, moved)

    return retrace(closed, override, env=env)
