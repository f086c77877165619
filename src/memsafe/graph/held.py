"""A lower bound on the bytes XLA holds at once for a program, without compiling it.

:func:`memsafe.graph.estimate` guesses which values XLA materializes, and can count more than
XLA keeps (fusion removes an elementwise value, a schedule frees one early). Here only what every
compile must hold is counted: the arguments, the outputs and the temporaries that are
**contraction results** (``dot_general``), which XLA's CPU backend (YNNPACK fusions off, as
memsafe compiles, ``memsafe.xla.CPU_COMPILER_OPTIONS``) writes to a buffer of their own, and
which cannot share one with another such result while both are live. Two results are live at
once in every schedule where one (``b``) depends on the other (``a``) and some use of ``a``
depends on ``b``: when ``b`` is computed, ``a`` is still to be read (a value saved in a forward
pass for its gradient is live when every later forward contraction is computed). The bound is
the arguments, the outputs and the largest such set of results live with one of them.

Kept conservative on purpose: results identical in structure are counted once (XLA's CSE may
merge them: a checkpointed forward and its recomputation), contractions XLA may rewrite into
fusible code (a small or broadcast operand) or write into an output's buffer are not counted, and
a program with donated arguments is not bounded. The search skips compiling the original program
where the bound alone is over the limit (:mod:`memsafe.search`).
"""

from __future__ import annotations

from collections.abc import Set
from dataclasses import dataclass
from typing import Any

from memsafe._jax import ClosedJaxpr, Literal, Var, nbytes_of_aval
from memsafe.primitives import BROADCASTS, ELEMENTWISE, FUSIBLE, GENERATORS

__all__ = ["HELD", "HeldPolicy", "held_bytes"]


@dataclass(frozen=True)
class HeldPolicy:
    """Which contractions the bound counts.

    Attributes:
        min_extent: a contraction is counted only where its contracted size and each operand's
            free size (the elements it contributes to the result apart from batch axes) are at
            least this: XLA rewrites a matrix-vector or outer product into fusible code.
        generated: producers of an operand after which XLA may fold the contraction away (a
            broadcast: a dot with a broadcast becomes a reduction).
    """

    min_extent: int = 16
    generated: Set[str] = BROADCASTS | GENERATORS


#: The policy the search uses.
HELD = HeldPolicy()


def held_bytes(closed: ClosedJaxpr, policy: HeldPolicy = HELD) -> int:
    """Bytes XLA holds at once in any compile of ``closed`` (top level, calls inlined, nothing
    donated): arguments, distinct outputs, and the largest set of contraction results live
    together (see the module's docstring).

    Args:
        closed: the program, its calls inlined (:func:`memsafe.graph.inline_calls`).
        policy: which contractions count.

    Returns:
        A lower bound on XLA's footprint of ``closed`` (arguments + outputs + temporaries).
    """
    jaxpr = closed.jaxpr
    eqns = jaxpr.eqns
    producer: dict[Var, int] = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    alive = _alive(closed, producer)
    outputs = {v for v in jaxpr.outvars if isinstance(v, Var)}
    fixed = sum(nbytes_of_aval(v.aval) for v in jaxpr.invars)
    fixed += sum(nbytes_of_aval(v.aval) for v in outputs if v in producer)
    users = _users(eqns, alive)
    inputs = set(jaxpr.invars)
    roots = [
        i
        for i in alive
        if eqns[i].primitive.name == "dot_general"
        and _counted(eqns[i], producer, eqns, inputs, policy)
        and not _reaches_output(eqns[i].outvars[0], eqns, users, outputs)
    ]
    counted = _closures(eqns, alive, roots, users)
    if not counted:
        return fixed
    below = _descendants(eqns, alive, users)
    keys = _structure(closed)
    best = 0
    for b in counted:
        live = {keys[eqns[b].outvars[0]]: nbytes_of_aval(eqns[b].outvars[0].aval)}
        for a, held_a in counted.items():
            if a == b or not (below[a] >> b) & 1:
                continue  # b does not depend on a
            if any((below[b] >> c) & 1 for c in held_a.users):
                key = keys[eqns[a].outvars[0]]
                live[key] = max(live.get(key, 0), held_a.bytes)
        best = max(best, sum(live.values()))
    return fixed + best


@dataclass(frozen=True)
class _Held:
    """A contraction result and what carries its elements on (see :func:`_closure`).

    Attributes:
        bytes: the fewest bytes any of those values takes (one of them is in memory while any
            of ``users`` is still to run).
        users: the live equations that read one of them.
    """

    bytes: int
    users: frozenset[int]


def _closures(
    eqns: Any, alive: list[int], roots: list[int], users: dict[Var, list[int]]
) -> dict[int, _Held]:
    """For each contraction in ``roots``: its result and the values computed from it by
    elementwise operations whose other operands carry no other root's elements
    (``tanh(x @ w + b)``, a masked softmax's ``exp(s - max)``). Each has the root's elements,
    and is in at most one root's set (so never shares a buffer with another root's); while one
    of them is still to be read, one of them is in memory (the reader reads it, or fuses its
    computation from one that is)."""
    root_of: dict[Var, int] = {eqns[i].outvars[0]: i for i in roots}
    smallest = {i: nbytes_of_aval(eqns[i].outvars[0].aval) for i in roots}
    for i in alive:
        eqn = eqns[i]
        if eqn.primitive.name not in ELEMENTWISE or len(eqn.outvars) != 1:
            continue
        found = {root_of[u] for u in eqn.invars if isinstance(u, Var) and u in root_of}
        out = eqn.outvars[0]
        if len(found) != 1 or out in root_of:
            continue
        (root,) = found
        if getattr(out.aval, "shape", None) != eqns[root].outvars[0].aval.shape:
            continue
        root_of[out] = root
        smallest[root] = min(smallest[root], nbytes_of_aval(out.aval))
    readers: dict[int, set[int]] = {i: set() for i in roots}
    for v, root in root_of.items():
        readers[root].update(users.get(v, ()))
    return {i: _Held(smallest[i], frozenset(readers[i])) for i in roots}


def _alive(closed: ClosedJaxpr, producer: dict[Var, int]) -> list[int]:
    """Indices of the equations an output depends on (XLA removes the others), in order."""
    eqns = closed.jaxpr.eqns
    needed = {v for v in closed.jaxpr.outvars if isinstance(v, Var)}
    alive: list[int] = []
    for i in reversed(range(len(eqns))):
        if any(v in needed for v in eqns[i].outvars):
            alive.append(i)
            needed.update(v for v in eqns[i].invars if isinstance(v, Var))
    return alive[::-1]


def _counted(
    eqn: Any, producer: dict[Var, int], eqns: Any, inputs: set[Var], policy: HeldPolicy
) -> bool:
    """Whether XLA surely writes this contraction's result to a buffer of its own: not a
    product XLA may fold away (of a broadcast or iota, looking through conversions and layout
    changes, or of two constants) or rewrite into fusible code (``policy.min_extent``)."""
    (contract_l, contract_r), (batch_l, batch_r) = eqn.params["dimension_numbers"]
    lhs, rhs = eqn.invars
    sources = []
    for operand in (lhs, rhs):
        if isinstance(operand, Literal) or not hasattr(operand.aval, "shape"):
            return False
        source = _source(operand, producer, eqns, policy.generated)
        made = producer.get(source)
        if made is not None and eqns[made].primitive.name in policy.generated:
            return False
        sources.append(source)
    if all(producer.get(v) is None and v not in inputs for v in sources):
        return False  # constants both: XLA may fold the product
    contracted = _size(lhs.aval.shape, contract_l)
    free_l = _size(lhs.aval.shape, range(len(lhs.aval.shape))) // max(
        1, contracted * _size(lhs.aval.shape, batch_l)
    )
    free_r = _size(rhs.aval.shape, range(len(rhs.aval.shape))) // max(
        1, _size(rhs.aval.shape, contract_r) * _size(rhs.aval.shape, batch_r)
    )
    return min(contracted, free_l, free_r) >= policy.min_extent


def _source(var: Var, producer: dict[Var, int], eqns: Any, stop: Set[str]) -> Var:
    """``var`` traced back through fusible operations of one operand (a conversion, a reshape,
    a transpose), up to one in ``stop``: the value whose elements it carries."""
    while True:
        made = producer.get(var)
        if made is None:
            return var
        eqn = eqns[made]
        operands = [v for v in eqn.invars if isinstance(v, Var)]
        name = eqn.primitive.name
        if name in stop or name not in FUSIBLE or len(operands) != 1 or len(eqn.invars) != 1:
            return var
        var = operands[0]


def _size(shape: tuple[int, ...], axes: Any) -> int:
    out = 1
    for axis in axes:
        out *= int(shape[axis])
    return out


def _reaches_output(var: Var, eqns: Any, users: dict[Var, list[int]], outputs: set[Var]) -> bool:
    """Whether ``var`` flows into an output through fusible operations only (its buffer may
    then be the output's, counted among the outputs)."""
    stack, seen = [var], {var}
    while stack:
        v = stack.pop()
        if v in outputs:
            return True
        for c in users.get(v, ()):
            if eqns[c].primitive.name not in FUSIBLE:
                continue
            for o in eqns[c].outvars:
                if o not in seen:
                    seen.add(o)
                    stack.append(o)
    return False


def _users(eqns: Any, alive: list[int]) -> dict[Var, list[int]]:
    """Each value's live consumers' indices."""
    out: dict[Var, list[int]] = {}
    for i in alive:
        for v in eqns[i].invars:
            if isinstance(v, Var):
                out.setdefault(v, []).append(i)
    return out


def _descendants(eqns: Any, alive: list[int], users: dict[Var, list[int]]) -> dict[int, int]:
    """Each live equation's descendants (itself included), as a bit set of indices."""
    below: dict[int, int] = {}
    for i in reversed(alive):
        bits = 1 << i
        for v in eqns[i].outvars:
            for c in users.get(v, ()):
                bits |= below[c]
        below[i] = bits
    return below


def _structure(closed: ClosedJaxpr) -> dict[Var, int]:
    """A hash of each value's computation (primitive, result type, operands' hashes; the
    parameters left out, so that more values compare equal: the bound stays a lower one)."""
    keys: dict[Var, int] = {}
    for k, v in enumerate(closed.jaxpr.invars):
        keys[v] = hash(("input", k))
    for k, v in enumerate(closed.jaxpr.constvars):
        keys[v] = hash(("const", k))
    for eqn in closed.jaxpr.eqns:
        operands = tuple(
            keys.get(v, 0) if isinstance(v, Var) else hash(("literal", repr(v.val)))
            for v in eqn.invars
        )
        for k, v in enumerate(eqn.outvars):
            shape = getattr(v.aval, "shape", ())
            keys[v] = hash((eqn.primitive.name, k, tuple(shape), str(v.aval), operands))
    return keys
