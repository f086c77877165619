"""Online softmax: a staged max-shifted exp-sum region run as ONE loop with running rescaling.

A region whose later stages need ``m = max(s, axis)`` (softmax, log-sum-exp, attention) would
otherwise run one loop per stage, recomputing ``s``. When the region has the structure

- ``u = g(m)``: outside values computed from the region's max sinks by any small chain ``g``
  (``max(-inf, m)``, ``stop_gradient``, broadcasts, the is-finite guard of logsumexp);
- ``u`` used only as a shift in ``exp(x - u)``;
- everything downstream of such exps *scaled* by factors constant along the axis (products with
  values that do not depend on the shift, divisions by them, layout changes, sums over other
  axes, batched contractions), consumed by sums or contractions along the axis;
- values computed from the region's sink results (``sum(e)`` of softmax) used only as
  multiplicative factors (``e / sum(e)``) on the way to those sums,

the stages merge into one loop (Milakov & Gimelshein's online normaliser, Rabe & Staats'
memory-efficient attention): each chunk updates the running max, recomputes ``u`` from it, and
rescales every accumulator by ``exp(u_old - u_new)`` carried to the accumulator's layout.
Multiplicative factors computed after the loop are applied to the finished accumulators.

A factor is an expression tree over *bases* (a shift ``u`` or a late factor ``L`` with a power)
and the equations that carried it to a value, evaluated on arrays that have size 1 along the
split axis and along every axis the factor is constant on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, Literal, Var, bind_eqn
from memsafe.graph import Graph
from memsafe.primitives import Scaling, facts
from memsafe.split import peephole
from memsafe.split import sinks as sink_ops
from memsafe.split.region import Region, region_depends
from memsafe.split.registry import Mapping
from memsafe.split.sinks import Sink

#: Factor trees: ("base", var, power, rank) | ("mul", a, b) | ("op", eqn index, (sub-factors)).
Factor = tuple


def _scaling(name: str) -> Scaling | None:
    return facts(name).scaling


def _inexact(atom: Any) -> bool:
    return bool(jnp.issubdtype(atom.aval.dtype, jnp.inexact))


class NotOnline(Exception):
    """The region does not have the online-softmax structure (the message says why)."""


@dataclass(frozen=True)
class OnlinePlan:
    """How a staged region runs as one loop."""

    sources: tuple[int, ...]  # max sinks whose running values define the shifts
    chain: tuple[int, ...]  # outside equations computing shifts from the sources, program order
    shifts: tuple[Var, ...]  # outside values subtracted before an exp
    passthrough: dict[int, int]  # region eqn multiplying/dividing by a late factor -> kept operand
    late: tuple[Var, ...]  # outside values applied to accumulators after the loop
    factors: dict[int, Factor]  # scaled sink -> factor of its result
    deferred: tuple[int, ...]  # scaled sinks whose factors need late values
    whole: tuple[Var, ...]  # outside values the loop reads whole (region and chain)


def _rank(atom: Any) -> int:
    return len(getattr(atom.aval, "shape", ()))


def _is_zero(graph: Graph, atom: Any) -> bool:
    """A literal zero or a broadcast of one (``jnp.where(mask, e, 0)``)."""
    if isinstance(atom, Literal):
        return bool(jnp.all(jnp.asarray(atom.val) == 0))
    p = graph.info(atom).producer
    if p is None:
        return False
    eqn = graph.eqns[p]
    return eqn.primitive.name == "broadcast_in_dim" and _is_zero(graph, eqn.invars[0])


def analyse(graph: Graph, region: Region) -> OnlinePlan:
    """The online plan of a staged region; raises :class:`NotOnline`."""
    eqns = graph.eqns
    maps = region.maps
    depends = region_depends(graph, maps)
    sinks = region.sinks
    max_sinks = {i for i, s in sinks.items() if s.reducer is sink_ops.MAX}
    kind: dict[Var, Any] = {}  # region value -> "plain" | "shifted" | Factor
    shifts: dict[Var, None] = {}
    late: dict[Var, None] = {}
    passthrough: dict[int, int] = {}
    factors: dict[int, Factor] = {}

    def post(atom: Any) -> bool:
        return isinstance(atom, Var) and not isinstance(atom, Literal) and bool(depends.get(atom))

    def of(atom: Any) -> Any:
        if isinstance(atom, Literal) or atom not in region.produced:
            return "post" if post(atom) else "plain"
        return kind[atom]

    for i in sorted(maps):
        eqn, m = eqns[i], maps[i]
        name = eqn.primitive.name
        scaling = _scaling(name)
        ins = [of(a) for a in eqn.invars]
        if any(k == "post" and ax is not None for k, ax in zip(ins, m.ins)):
            raise NotOnline(f"{name} reads a result of the region split along the axis")
        scaled = [k for k in ins if isinstance(k, tuple)]
        rank = _rank(eqn.outvars[0])
        if "shifted" in ins and name != "exp":
            raise NotOnline(f"a shifted value reaches {name}, not exp")
        if isinstance(m, Sink):
            if "post" in ins:
                raise NotOnline(f"{name} reads a value computed from the region's results")
            if scaled:
                if not m.reducer.rescalable:
                    raise NotOnline(f"a rescaled value reaches a {m.kind} sink")
                factors[i] = _combine_op(i, ins)
            continue
        out: Any
        if not scaled and "post" not in ins and "shifted" not in ins:
            out = "plain"
        elif name == "sub" and ins == ["plain", "post"] and m.ins[1] is None:
            u = eqn.invars[1]
            if not depends[u] <= max_sinks:
                raise NotOnline("an exp is shifted by a value that is not a running max")
            shifts[u] = None
            out = "shifted"
        elif name == "exp" and ins == ["shifted"]:
            u = eqns[graph.info(eqn.invars[0]).producer].invars[1]
            out = ("base", u, 1, rank)
        elif name == "mul" and "post" in ins:
            if ins.count("post") != 1:
                raise NotOnline("a product of two values computed from the region's results")
            j = ins.index("post")
            other = 1 - j
            late[eqn.invars[j]] = None
            passthrough[i] = other
            base = ("base", eqn.invars[j], 1, rank)
            out = base if ins[other] == "plain" else ("mul", ins[other], base)
        elif name == "div" and ins[1] == "post" and ins[0] != "post" and m.ins[1] is None:
            late[eqn.invars[1]] = None
            passthrough[i] = 0
            base = ("base", eqn.invars[1], -1, rank)
            out = base if ins[0] == "plain" else ("mul", ins[0], base)
        elif "post" in ins:
            raise NotOnline(f"{name} reads a value computed from the region's results")
        elif name == "mul":
            out = scaled[0] if len(scaled) == 1 else ("mul", scaled[0], scaled[1])
        elif scaling is Scaling.COMMUTES and not _inexact(eqn.outvars[0]):
            raise NotOnline(f"a rescaled value converted to {eqn.outvars[0].aval.dtype}")
        elif (name == "div" and not isinstance(ins[1], tuple)) or scaling is Scaling.COMMUTES:
            out = ins[0]
        elif scaling is Scaling.SAME:
            cases = list(zip(eqn.invars, ins))[1:] if name == "select_n" else zip(eqn.invars, ins)
            if name == "select_n" and isinstance(ins[0], tuple):
                raise NotOnline("select_n on a rescaled predicate")
            trees = {k for a, k in cases if not _is_zero(graph, a) or isinstance(k, tuple)}
            if len(trees) != 1 or not isinstance(next(iter(trees)), tuple):
                raise NotOnline(f"{name} mixes differently scaled values")
            out = trees.pop()
        elif scaling is Scaling.LAYOUT or name in ("reduce_sum", "dot_general"):
            out = _combine_op(i, ins)
        else:
            raise NotOnline(f"a rescaled value reaches {name}")
        for o in eqn.outvars:
            kind[o] = out

    if not shifts:
        raise NotOnline("no exp shifted by a running max")
    for v in region.surviving:
        if kind.get(v) != "plain":
            raise NotOnline("a rescaled value is needed outside the region")
    sources = sorted(set().union(*(depends[u] for u in shifts)))
    for i in sources:
        if of(eqns[i].invars[0]) != "plain":
            raise NotOnline("a running max of a rescaled value")
    chain = _chain(graph, maps, depends, list(shifts))
    deferred = tuple(i for i, f in factors.items() if _has_late(f, late))
    for v in late:
        if depends[v] & set(deferred):
            raise NotOnline("a late factor needs another late-scaled result")
    whole = _whole_inputs(graph, region, chain, depends)
    plan = OnlinePlan(
        tuple(sources), chain, tuple(shifts), passthrough, tuple(late), factors, deferred, whole
    )
    _check_shapes(graph, plan)
    return plan


def _combine_op(i: int, ins: list[Any]) -> Factor:
    return ("op", i, tuple(k if isinstance(k, tuple) else None for k in ins))


def _has_late(f: Factor | None, late: dict[Var, None]) -> bool:
    if f is None:
        return False
    if f[0] == "base":
        return f[1] in late
    if f[0] == "mul":
        return _has_late(f[1], late) or _has_late(f[2], late)
    return any(_has_late(s, late) for s in f[2])


def _chain(graph: Graph, maps: dict, depends: dict[Var, set[int]], shifts: list[Var]) -> tuple:
    """Outside equations between the max sinks and the shifts (evaluated per chunk)."""
    need: set[int] = set()
    stack = list(shifts)
    while stack:
        v = stack.pop()
        p = graph.info(v).producer
        if p is None or p in need:
            continue
        eqn = graph.eqns[p]
        if p in maps:
            if isinstance(maps[p], Sink):
                continue  # a running max, given by the loop
            if any(isinstance(a, Var) and not isinstance(a, Literal) for a in eqn.invars):
                raise NotOnline("a shift needs a value computed chunk by chunk")
            need.add(p)  # a generator (broadcast literal, iota): recomputed at full shape
            continue
        if not depends.get(v):
            continue
        need.add(p)
        stack.extend(a for a in eqn.invars if isinstance(a, Var))
    return tuple(sorted(need))


def _whole_inputs(graph: Graph, region: Region, chain: tuple, depends: dict) -> tuple[Var, ...]:
    """Outside values computed before the loop that region or chain equations read whole."""
    out: dict[Var, None] = {}
    for i in (*region.maps, *chain):
        m = region.maps.get(i) if i not in chain else None
        for k, a in enumerate(graph.eqns[i].invars):
            if not isinstance(a, Var) or isinstance(a, Literal) or a in region.produced:
                continue
            if m is not None and m.ins[k] is not None:
                continue
            if not depends.get(a):
                out[a] = None
    return tuple(out)


# -- evaluating factors ------------------------------------------------------------------------


def evaluate(graph: Graph, f: Factor | None, bases: dict[Var, Any]) -> Any | None:
    """The factor's array from the base arrays given (a missing base counts as one; None: one)."""
    if f is None:
        return None
    tag = f[0]
    if tag == "base":
        _, var, power, rank = f
        b = bases.get(var)
        if b is None:
            return None
        if b.ndim != rank:
            b = jnp.reshape(b, (1,) * rank)
        return b if power == 1 else lax.integer_pow(b, power)
    if tag == "mul":
        a, b = evaluate(graph, f[1], bases), evaluate(graph, f[2], bases)
        return b if a is None else a if b is None else a * b
    _, i, subs = f
    vals = [evaluate(graph, s, bases) for s in subs]
    if all(v is None for v in vals):
        return None
    return _apply(graph.eqns[i], vals)


def _apply(eqn: JaxprEqn, vals: list[Any]) -> Any:
    """``eqn`` applied to factor arrays (None: a factor of one in that operand)."""
    name = eqn.primitive.name
    p = eqn.params
    if name == "dot_general":
        return _dot(eqn, vals)
    (f,) = [v for v in vals if v is not None]
    if name == "broadcast_in_dim":
        dims = p["broadcast_dimensions"]
        shape = [1] * len(p["shape"])
        for j, d in enumerate(dims):
            shape[d] = f.shape[j]
        return lax.broadcast_in_dim(f, tuple(shape), dims)
    if name == "transpose":
        return lax.transpose(f, p["permutation"])
    if name == "squeeze":
        return lax.squeeze(f, p["dimensions"])
    if name == "expand_dims":
        return lax.expand_dims(f, p["dimensions"])
    if name == "reshape":
        if any(s != 1 for s in f.shape):
            raise NotOnline("a reshape of a rescaled value")
        return jnp.reshape(f, (1,) * len(p["new_sizes"]))
    if name == "reduce_sum":
        axes = tuple(p["axes"])
        if any(f.shape[a] != 1 for a in axes):
            raise NotOnline("a sum over an axis the factor varies along")
        return lax.squeeze(f, axes)
    raise NotOnline(f"cannot carry a factor through {name}")


def _dot(eqn: JaxprEqn, vals: list[Any]) -> Any:
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    ranks = [_rank(a) for a in eqn.invars]
    fa, fb = (v if v is not None else jnp.ones((1,) * r) for v, r in zip(vals, ranks))
    if any(fa.shape[d] != 1 for d in lc) or any(fb.shape[d] != 1 for d in rc):
        raise NotOnline("a contraction over an axis the factor varies along")
    sa, sb = list(fa.shape), list(fb.shape)
    for a, b in zip(lb, rb):
        sa[a] = sb[b] = max(sa[a], sb[b])
    fa, fb = jnp.broadcast_to(fa, sa), jnp.broadcast_to(fb, sb)
    dtype = jnp.result_type(fa.dtype, fb.dtype)
    return lax.dot_general(fa.astype(dtype), fb.astype(dtype), ((lc, rc), (lb, rb)))


def _check_shapes(graph: Graph, plan: OnlinePlan) -> None:
    """Evaluate every sink factor abstractly: raises NotOnline if one cannot be carried."""
    names = plan.shifts + plan.late
    structs = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in names]

    def run(vals: list) -> list:
        b = dict(zip(names, vals))
        return [evaluate(graph, f, b) for f in plan.factors.values()]

    try:
        jax.eval_shape(run, structs)
    except NotOnline:
        raise
    except Exception as err:  # shapes that do not line up
        raise NotOnline(f"factor shapes do not line up: {err}") from err


def merge(graph: Graph, region: Region) -> bool:
    """Turn a staged region into one online loop when it has the structure; True if it did."""
    if region.n_stages < 2:
        return False
    try:
        region.online = analyse(graph, region)
    except NotOnline:
        return False
    region.stage = dict.fromkeys(region.maps, 0)
    return True


# -- running the loop -------------------------------------------------------------------------


def raw_key(i: int) -> tuple[str, int]:
    """Name of a deferred sink's unfinished accumulator between the loop and its finish."""
    return ("online-raw", i)


def loop_io(graph: Graph, region: Region) -> tuple[list, list, list, list]:
    """(loop inputs, loop outputs, finish inputs, finish outputs) of an online region."""
    plan: OnlinePlan = region.online
    eqns = graph.eqns
    ins = [*region.sliced, *plan.whole]
    outs: list[Any] = []
    for i in sorted(region.sinks):
        outs.extend([raw_key(i)] if i in plan.deferred else eqns[i].outvars)
    outs.extend(v for v in region.surviving)
    fin_in = [raw_key(i) for i in plan.deferred] + list(plan.late)
    fin_out = [o for i in plan.deferred for o in eqns[i].outvars]
    return ins, outs, fin_in, fin_out


def finish(graph: Graph, region: Region, env: dict[Any, Any]) -> list[Any]:
    """Deferred sinks' results: their accumulators times their late factors."""
    plan: OnlinePlan = region.online
    bases = {v: env[v] for v in plan.late}
    out = []
    for i in plan.deferred:
        acc = env[raw_key(i)]
        f = evaluate(graph, plan.factors[i], bases)
        out.append(acc if f is None else acc * f.astype(acc.dtype))
    return out


def run_loop(graph: Graph, region: Region, chunk: int, env: dict[Any, Any]) -> list[Any]:
    """All chunks of an online region; values in the order of ``loop_io``'s loop outputs."""
    plan: OnlinePlan = region.online
    eqns = graph.eqns
    axis_of = region.axis_of
    sliced = list(region.sliced)
    sliced_vals = [env[v] for v in sliced]
    whole_vals = [env[v] for v in plan.whole]
    chain = set(plan.chain)
    order = sorted(set(region.maps) | chain)
    sources = list(plan.sources)
    others = [i for i in sorted(region.sinks) if i not in plan.sources]
    surviving = list(region.surviving)
    region_eqns = [i for i in order if i in region.maps and i not in plan.passthrough]
    peep = peephole.plan(graph, region, region_eqns, chunk)

    def body(start: Any, n: int, sl: list, wh: list, old: list | None) -> tuple:
        local: dict[Any, Any] = {}
        outer = dict(zip(plan.whole, wh))
        for v, val in zip(sliced, sl):
            local[v] = lax.dynamic_slice_in_dim(val, start, n, axis_of[v])

        full: dict[Any, Any] = {}  # whole-shape values of the shift chains

        def read(atom: Any, ax: Any) -> Any:
            if isinstance(atom, Literal):
                return atom.val
            if ax is not None:
                return local[atom]
            return full[atom] if atom in full else outer[atom]

        def read_full(atom: Any) -> Any:
            if isinstance(atom, Literal):
                return atom.val
            return full[atom] if atom in full else outer[atom]

        running: dict[int, Any] = {}
        partials: dict[int, Any] = {}
        for i in order:
            eqn = eqns[i]
            if i in peep.skip and i not in chain:
                continue
            if i in chain:
                full.update(zip(eqn.outvars, bind_eqn(eqn, [read_full(a) for a in eqn.invars])))
                if i not in region.maps:
                    continue
            m = region.maps[i]
            if i in plan.passthrough:
                pos = plan.passthrough[i]
                val = read(eqn.invars[pos], m.ins[pos])
                shape = list(eqn.outvars[0].aval.shape)
                shape[m.outs[0]] = n
                local[eqn.outvars[0]] = jnp.broadcast_to(val, shape).astype(
                    eqn.outvars[0].aval.dtype
                )
                continue
            moved = peep.norm.get(i, {})
            invals = [
                None if k in moved else read(a, ax)
                for k, (a, ax) in enumerate(zip(eqn.invars, m.ins))
            ]
            if isinstance(m, Sink):
                part = m.reducer.partial(eqn, invals, m.axis, start, n)
                if i in plan.sources:
                    k = sources.index(i)
                    part = part if old is None else m.reducer.fold(eqn, old[k], part)
                    running[i] = part
                    full.update(zip(eqn.outvars, m.reducer.finish(part)))
                else:
                    partials[i] = part
                continue
            assert isinstance(m, Mapping)
            outs = peephole.bind_mapped(peep, i, eqn, invals, m, read, local, eqns, start, n)
            local.update(zip(eqn.outvars, outs))
        return (
            [running[i] for i in sources],
            [full[u] for u in plan.shifts],
            [partials[i] for i in others],
            [local[v] for v in surviving],
        )

    def chunk_fn(n: int) -> Callable[..., tuple]:
        return jax.checkpoint(lambda start, sl, wh, old: body(start, n, sl, wh, old))

    def first_fn(n: int) -> Callable[..., tuple]:
        return jax.checkpoint(lambda start, sl, wh: body(start, n, sl, wh, None))

    def fold(accs: list, parts: list, u_old: list, u_new: list) -> list:
        r = {
            u: jnp.where(a == b, jnp.ones_like(a), jnp.exp(a - b))
            for u, a, b in zip(plan.shifts, u_old, u_new)
        }
        out = []
        for i, acc, part in zip(others, accs, parts):
            s = region.maps[i]
            if i in plan.factors:
                scale = evaluate(graph, plan.factors[i], r)
                if scale is not None:
                    scale = scale.astype(acc[0].dtype)
                    acc = tuple(jnp.where(scale == 0, jnp.zeros_like(a), a * scale) for a in acc)
            out.append(s.reducer.fold(eqns[i], acc, part))
        return out

    def write(bufs: list, vals: list, start: Any) -> list:
        return [
            lax.dynamic_update_slice_in_dim(b, v, start, axis_of[var])
            for b, v, var in zip(bufs, vals, surviving)
        ]

    size = region.size
    n_full, rem = divmod(size, chunk)
    maxes, us, accs, first = first_fn(chunk)(jnp.int32(0), sliced_vals, whole_vals)
    bufs = write([jnp.zeros(v.aval.shape, v.aval.dtype) for v in surviving], first, jnp.int32(0))
    full_fn = chunk_fn(chunk)

    def step(carry: tuple, i: Any) -> tuple[tuple, None]:
        maxes, us, accs, bufs, start = carry[0], carry[1], carry[2], carry[3], i * chunk
        new_max, new_us, parts, vals = full_fn(start, sliced_vals, whole_vals, maxes)
        accs = fold(accs, parts, us, new_us)
        return (new_max, new_us, accs, write(bufs, vals, start)), None

    if n_full > 1:
        init = (maxes, us, accs, bufs)
        (maxes, us, accs, bufs), _ = lax.scan(step, init, jnp.arange(1, n_full, dtype=jnp.int32))
    if rem:
        start = jnp.int32(n_full * chunk)
        new_max, new_us, parts, vals = chunk_fn(rem)(start, sliced_vals, whole_vals, maxes)
        accs = fold(accs, parts, us, new_us)
        maxes, bufs = new_max, write(bufs, vals, start)
    results: list[Any] = []
    finals = dict(zip(sources, maxes)) | dict(zip(others, accs))
    for i in sorted(region.sinks):
        got = region.maps[i].reducer.finish(finals[i])
        results.extend([got[0]] if i in plan.deferred else got)
    return results + list(bufs)
