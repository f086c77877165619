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

A :class:`Factor` is an expression tree over *bases* (a shift ``u`` or a late factor ``L`` with a
power) and the equations that carried it to a value, evaluated on arrays that have size 1 along
the split axis and along every axis the factor is constant on.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memsafe import policy
from memsafe._jax import JaxprEqn, Literal, Var, bind_eqn, is_var
from memsafe.graph import Graph
from memsafe.graph.interpret import Group, evaluate_eqns
from memsafe.primitives import Scaling, facts
from memsafe.split import loop as chunk_loop
from memsafe.split import peephole
from memsafe.split import sinks as sink_ops
from memsafe.split.emit import OneDevice
from memsafe.split.loop import Carry, ChunkEnv, Written
from memsafe.split.region import Region, region_depends
from memsafe.split.sinks import Sink, finished


class NotOnline(Exception):
    """The region does not have the online-softmax structure (the message says why)."""


def _rank(atom: Any) -> int:
    return len(getattr(atom.aval, "shape", ()))


def _inexact(atom: Any) -> bool:
    return bool(jnp.issubdtype(atom.aval.dtype, jnp.inexact))


# -- factors -------------------------------------------------------------------------------------


class Factor:
    """A multiplicative factor constant along the split axis, as an expression over bases."""

    def value(self, graph: Graph, bases: dict[Var, Any]) -> Any | None:
        """The factor's array from the base arrays given (a missing base counts as one; None:
        the factor is one)."""
        raise NotImplementedError

    def bases(self) -> set[Var]:
        raise NotImplementedError


@dataclass(frozen=True)
class Base(Factor):
    """A shift ``u`` (as ``exp(-u)``'s rescale) or a late factor, to ``power``, at ``rank``."""

    var: Var
    power: int
    rank: int

    def value(self, graph: Graph, bases: dict[Var, Any]) -> Any | None:
        b = bases.get(self.var)
        if b is None:
            return None
        if b.ndim != self.rank:
            b = jnp.reshape(b, (1,) * self.rank)
        return b if self.power == 1 else lax.integer_pow(b, self.power)

    def bases(self) -> set[Var]:
        return {self.var}


@dataclass(frozen=True)
class Product(Factor):
    a: Factor
    b: Factor

    def value(self, graph: Graph, bases: dict[Var, Any]) -> Any | None:
        a, b = self.a.value(graph, bases), self.b.value(graph, bases)
        return b if a is None else a if b is None else a * b

    def bases(self) -> set[Var]:
        return self.a.bases() | self.b.bases()


@dataclass(frozen=True)
class Through(Factor):
    """Factors of the operands of equation ``index``, carried through it (layout, sums)."""

    index: int
    operands: tuple[Factor | None, ...]

    def value(self, graph: Graph, bases: dict[Var, Any]) -> Any | None:
        vals = [None if f is None else f.value(graph, bases) for f in self.operands]
        if all(v is None for v in vals):
            return None
        return _apply(graph.eqns[self.index], vals)

    def bases(self) -> set[Var]:
        return set().union(*(f.bases() for f in self.operands if f is not None))


class Plain:
    """A region value not touched by a shift."""


class Shifted:
    """``x - u``: a value shifted by a running maximum, allowed only into ``exp``."""


class Post:
    """An outside value computed from the region's results."""


PLAIN, SHIFTED, POST = Plain(), Shifted(), Post()
#: How a value relates to the online structure.
Role = Plain | Shifted | Post | Factor


def _through(i: int, ins: list[Role]) -> Through:
    return Through(i, tuple(k if isinstance(k, Factor) else None for k in ins))


def _times(scaled: Role, base: Base) -> Factor:
    return base if isinstance(scaled, Plain) else Product(scaled, base)  # type: ignore[arg-type]


def _is_zero(graph: Graph, atom: Any) -> bool:
    """A literal zero or a broadcast of one (``jnp.where(mask, e, 0)``)."""
    if isinstance(atom, Literal):
        return bool(np.all(np.asarray(atom.val) == 0))  # numpy: this may run inside a trace
    p = graph.info(atom).producer
    if p is None:
        return False
    eqn = graph.eqns[p]
    return eqn.primitive.name == "broadcast_in_dim" and _is_zero(graph, eqn.invars[0])


# -- the analysis ------------------------------------------------------------------------------


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


@dataclass
class _Analysis:
    """The walk over a region's equations that assigns each value its :data:`Role`."""

    graph: Graph
    region: Region
    depends: dict[Var, set[int]]
    role: dict[Var, Role] = field(default_factory=dict)
    shifts: dict[Var, None] = field(default_factory=dict)
    late: dict[Var, None] = field(default_factory=dict)
    passthrough: dict[int, int] = field(default_factory=dict)
    factors: dict[int, Factor] = field(default_factory=dict)

    def of(self, atom: Any) -> Role:
        if isinstance(atom, Literal) or atom not in self.region.produced:
            post = is_var(atom)
            return POST if post and self.depends.get(atom) else PLAIN
        return self.role[atom]

    def visit(self, i: int) -> None:
        eqn, m = self.graph.eqns[i], self.region.maps[i]
        name = eqn.primitive.name
        ins = [self.of(a) for a in eqn.invars]
        if any(k is POST and ax is not None for k, ax in zip(ins, m.ins)):
            raise NotOnline(f"{name} reads a result of the region split along the axis")
        if SHIFTED in ins and name != "exp":
            raise NotOnline(f"a shifted value reaches {name}, not exp")
        if isinstance(m, Sink):
            self.sink(i, m, ins)
            return
        out = self.mapped(i, eqn, ins)
        for o in eqn.outvars:
            self.role[o] = out

    def sink(self, i: int, m: Sink, ins: list[Role]) -> None:
        if POST in ins:
            raise NotOnline(f"{m.kind} reads a value computed from the region's results")
        if any(isinstance(k, Factor) for k in ins):
            if not m.reducer.rescalable:
                raise NotOnline(f"a rescaled value reaches a {m.kind} sink")
            self.factors[i] = _through(i, ins)

    def mapped(self, i: int, eqn: JaxprEqn, ins: list[Role]) -> Role:
        name = eqn.primitive.name
        m = self.region.maps[i]
        scaled = [k for k in ins if isinstance(k, Factor)]
        if not scaled and POST not in ins and SHIFTED not in ins:
            return PLAIN
        if name == "sub" and ins == [PLAIN, POST] and m.ins[1] is None:
            return self.shift(eqn.invars[1])
        if name == "exp" and ins == [SHIFTED]:
            u = self.graph.eqns[self.graph.info(eqn.invars[0]).producer].invars[1]
            return Base(u, 1, _rank(eqn.outvars[0]))
        if POST in ins:
            return self.late_factor(i, eqn, ins)
        return self.scaled(i, eqn, ins, scaled)

    def shift(self, u: Var) -> Role:
        max_sinks = {i for i, s in self.region.sinks.items() if s.reducer is sink_ops.MAX}
        if not self.depends[u] <= max_sinks:
            raise NotOnline("an exp is shifted by a value that is not a running max")
        self.shifts[u] = None
        return SHIFTED

    def late_factor(self, i: int, eqn: JaxprEqn, ins: list[Role]) -> Role:
        """A product with, or a division by, a value computed from the region's results."""
        name, rank = eqn.primitive.name, _rank(eqn.outvars[0])
        if name == "mul" and ins.count(POST) == 1:
            j = ins.index(POST)
            kept = 1 - j
        elif name == "div" and ins[1] is POST and ins[0] is not POST:
            if self.region.maps[i].ins[1] is not None:
                raise NotOnline("a division by a value split along the axis")
            j, kept = 1, 0
        else:
            raise NotOnline(f"{name} reads a value computed from the region's results")
        self.late[eqn.invars[j]] = None
        self.passthrough[i] = kept
        return _times(ins[kept], Base(eqn.invars[j], 1 if name == "mul" else -1, rank))

    def scaled(self, i: int, eqn: JaxprEqn, ins: list[Role], scaled: list[Factor]) -> Role:
        """A value computed from rescaled values: the factor it carries."""
        name = eqn.primitive.name
        scaling = facts(name).scaling
        if name == "mul":
            return scaled[0] if len(scaled) == 1 else Product(scaled[0], scaled[1])
        if scaling is Scaling.COMMUTES and not _inexact(eqn.outvars[0]):
            raise NotOnline(f"a rescaled value converted to {eqn.outvars[0].aval.dtype}")
        if (name == "div" and not isinstance(ins[1], Factor)) or scaling is Scaling.COMMUTES:
            return ins[0]
        if scaling is Scaling.SAME:
            return self.same(eqn, ins)
        if scaling is Scaling.LAYOUT or name in ("reduce_sum", "dot_general"):
            return _through(i, ins)
        raise NotOnline(f"a rescaled value reaches {name}")

    def same(self, eqn: JaxprEqn, ins: list[Role]) -> Role:
        """Sums and selections: every non-zero case must carry the same factor."""
        name = eqn.primitive.name
        cases = list(zip(eqn.invars, ins))
        if name == "select_n":
            if isinstance(ins[0], Factor):
                raise NotOnline("select_n on a rescaled predicate")
            cases = cases[1:]
        trees = {k for a, k in cases if not _is_zero(self.graph, a) or isinstance(k, Factor)}
        if len(trees) != 1 or not isinstance(next(iter(trees)), Factor):
            raise NotOnline(f"{name} mixes differently scaled values")
        return trees.pop()


def analyse(graph: Graph, region: Region) -> OnlinePlan:
    """The online plan of a staged region; raises :class:`NotOnline`."""
    depends = region_depends(graph, region.maps)
    walk = _Analysis(graph, region, depends)
    for i in sorted(region.maps):
        walk.visit(i)
    if not walk.shifts:
        raise NotOnline("no exp shifted by a running max")
    if any(walk.role.get(v) is not PLAIN for v in region.surviving):
        raise NotOnline("a rescaled value is needed outside the region")
    sources = sorted(set().union(*(depends[u] for u in walk.shifts)))
    if any(walk.of(graph.eqns[i].invars[0]) is not PLAIN for i in sources):
        raise NotOnline("a running max of a rescaled value")
    chain = _chain(graph, region.maps, depends, list(walk.shifts))
    late = set(walk.late)
    deferred = tuple(i for i, f in walk.factors.items() if f.bases() & late)
    if any(depends[v] & set(deferred) for v in walk.late):
        raise NotOnline("a late factor needs another late-scaled result")
    whole = _whole_inputs(graph, region, chain, depends)
    plan = OnlinePlan(
        tuple(sources), chain, tuple(walk.shifts), walk.passthrough, tuple(walk.late),
        walk.factors, deferred, whole,
    )  # fmt: skip
    _check_shapes(graph, plan)
    return plan


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
            if any(is_var(a) for a in eqn.invars):
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
            if not is_var(a) or a in region.produced:
                continue
            if m is not None and m.ins[k] is not None:
                continue
            if not depends.get(a):
                out[a] = None
    return tuple(out)


# -- evaluating factors ------------------------------------------------------------------------


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
        return [f.value(graph, b) for f in plan.factors.values()]

    try:
        jax.eval_shape(run, structs)
    except NotOnline:
        raise
    except Exception as err:  # shapes that do not line up
        raise NotOnline(f"factor shapes do not line up: {err}") from err


# -- running the loop ----------------------------------------------------------------------------


def raw_key(i: int) -> tuple[str, int]:
    """Name of a deferred sink's unfinished accumulator between the loop and its finish."""
    return ("online-raw", i)


@dataclass(frozen=True)
class Rescale(Carry):
    """Running maxima (the body folds them) and accumulators rescaled to each new shift.

    The state is (running max partials, shifts, other sinks' partials)."""

    graph: Graph
    region: Region
    plan: OnlinePlan
    others: tuple[int, ...]

    def feed(self, state: tuple) -> Any:
        return state[0]

    @property
    def starts_in_loop(self) -> bool:
        """The body selects its own maxima on the first chunk (:class:`chunk_loop.Started`): the
        first chunk runs in the loop, where XLA cannot merge it with a recomputation of the
        same chunk elsewhere and keep it alive in between (a checkpointed transformer's
        forward and backward at L=8192: four peeled 205 MiB chunks alive at once)."""
        return True

    def fold(self, state: tuple, parts: tuple) -> tuple:
        _, u_old, accs = state
        maxes, u_new, new = parts
        return maxes, u_new, self._fold_others(self._rescaled(accs, u_old, u_new), new)

    def _fold_others(self, accs: list, new: list) -> list:
        eqns = self.graph.eqns
        return [
            self.region.maps[i].reducer.fold(eqns[i], acc, part)
            for i, acc, part in zip(self.others, accs, new)
        ]

    def _rescaled(self, accs: list, u_old: list, u_new: list) -> list:
        """Accumulators made relative to the shifts ``u_new`` from ``u_old``."""
        ratio = {
            u: jnp.where(a == b, jnp.ones_like(a), jnp.exp(a - b))
            for u, a, b in zip(self.plan.shifts, u_old, u_new)
        }
        out = []
        for i, acc in zip(self.others, accs):
            factor = self.plan.factors.get(i)
            scale = None if factor is None else factor.value(self.graph, ratio)
            if scale is not None:
                scale = scale.astype(acc[0].dtype)
                acc = tuple(jnp.where(scale == 0, jnp.zeros_like(a), a * scale) for a in acc)
            out.append(acc)
        return out

    def across(self, state: tuple, axis_name: Any, operands: list[Any]) -> tuple:
        """Every device's running maxima and accumulators, merged in device order: the maxima
        folded, the shifts recomputed from them, both sides rescaled to the new shifts."""
        whole = operands[len(self.region.sliced) :]
        gathered = jax.tree.map(lambda a: lax.all_gather(a, axis_name), state)
        devices = jax.tree.leaves(gathered)[0].shape[0]
        acc = jax.tree.map(lambda g: g[0], gathered)
        for d in range(1, devices):
            new = jax.tree.map(lambda g, d=d: g[d], gathered)
            acc = self._merge(acc, new, whole)
        return acc

    def _merge(self, a: tuple, b: tuple, whole: list[Any]) -> tuple:
        eqns = self.graph.eqns
        maxes = [
            self.region.maps[i].reducer.fold(eqns[i], x, y)
            for i, x, y in zip(self.plan.sources, a[0], b[0])
        ]
        u = self._shifts(maxes, whole)
        accs = self._fold_others(self._rescaled(a[2], a[1], u), self._rescaled(b[2], b[1], u))
        return maxes, u, accs

    def _shifts(self, maxes: list, whole: list[Any]) -> list[Any]:
        """The shifts from the running maxima: the chain equations evaluated whole."""
        eqns = self.graph.eqns
        env: dict[Any, Any] = dict(zip(self.plan.whole, whole))
        for i, part in zip(self.plan.sources, maxes):
            env.update(zip(eqns[i].outvars, finished(self.region.maps[i].reducer, eqns[i], part)))
        evaluate_eqns(eqns, self.plan.chain, env)
        return [env[u] for u in self.plan.shifts]

    def results(self, state: tuple) -> list[Any]:
        finals = dict(zip(self.plan.sources, state[0])) | dict(zip(self.others, state[2]))
        out: list[Any] = []
        for i in sorted(self.region.sinks):
            got = finished(self.region.maps[i].reducer, self.graph.eqns[i], finals[i])
            out.extend([got[0]] if i in self.plan.deferred else got)
        return out


@dataclass(frozen=True)
class OnlineSplit(OneDevice):
    """A staged region whose stages merge into one loop with running rescaling."""

    region: Region
    plan: OnlinePlan

    @property
    def cost_weight(self) -> float:
        """Weight of the loop's iterations when choosing between axes (it rescales its
        accumulators every chunk)."""
        return policy.SPLIT.online_weight

    label: ClassVar[str | None] = "online_softmax"

    def fixed_bytes(self, graph: Graph) -> int:
        """Running shifts: old, new and the rescale factor."""
        return 3 * sum(graph.info(u).bytes for u in self.plan.shifts)

    def groups(
        self, graph: Graph, chunk: int, runner: chunk_loop.Runner = chunk_loop.run
    ) -> list[Group]:
        """The loop over every chunk (run by ``runner``), and the late factors applied after."""
        return [self._loop(graph, chunk, runner), late_factors(graph, self.region, self.plan)]

    def _loop(self, graph: Graph, chunk: int, runner: chunk_loop.Runner) -> Group:
        region, plan = self.region, self.plan
        sliced = tuple(region.sliced)
        order = sorted(set(region.maps) | set(plan.chain))
        others = tuple(i for i in sorted(region.sinks) if i not in plan.sources)
        carry = Rescale(graph, region, plan, others)
        mapped = [i for i in order if i in region.maps and i not in plan.passthrough]
        peep = peephole.plan(graph, region, mapped, chunk)
        body = _OnlineBody(graph, region, plan, sliced, order, others, peep)
        written = Written(
            tuple(region.surviving), tuple(region.axis_of[v] for v in region.surviving)
        )
        gives: list[Any] = []
        for i in sorted(region.sinks):
            gives.extend([raw_key(i)] if i in plan.deferred else graph.eqns[i].outvars)

        axes = chunk_loop.operand_axes(region.axis_of, sliced, plan.whole)

        def run_loop(operands: list[Any]) -> list[Any]:
            results, bufs = runner(body, region.size, chunk, operands, carry, written, axes)
            return results + bufs

        return Group(
            eqns=frozenset(region.maps),
            needs=(*sliced, *plan.whole),
            gives=(*gives, *region.surviving),
            position=min(region.maps),
            run=run_loop,
        )


@dataclass(frozen=True)
class _OnlineBody:
    """One chunk of an online region: shift chains at full shape, running maxima folded."""

    graph: Graph
    region: Region
    plan: OnlinePlan
    sliced: tuple[Var, ...]
    order: list[int]
    others: tuple[int, ...]
    peep: peephole.Peepholes

    def __call__(self, start: Any, n: int, ops: list[Any], old: list | None) -> tuple:
        region, plan, eqns = self.region, self.plan, self.graph.eqns
        k = len(self.sliced)
        peep = self.peep
        whole = dict(zip(plan.whole, ops[k:]))
        env = ChunkEnv.slice_in(
            self.graph, region, peep, start, n, list(zip(self.sliced, ops[:k])), whole
        )
        running: dict[int, Any] = {}
        partials: dict[int, Any] = {}

        def bind(i: int, eqn: JaxprEqn, invals: list[Any]) -> Sequence[Any]:
            if i in plan.chain and i not in region.maps:
                return bind_eqn(eqn, invals)  # read and defined whole (ChunkEnv)
            if i in plan.chain:  # a generator: whole for the chain, then at chunk shape
                outs = bind_eqn(eqn, [env.read(a, None) for a in eqn.invars])
                env.whole.update(zip(eqn.outvars, outs))
                if i in peep.skip:
                    return ()
            m = region.maps[i]
            if i in plan.passthrough:
                return [self._pass_through(invals, i, n)]
            if not isinstance(m, Sink):
                return env.step(i, eqn, invals)
            if i in plan.sources:
                part = self._running(i, env.partial(i, invals), old)
                running[i] = part
                # the running maximum, read whole by the chain
                return finished(m.reducer, eqn, part)
            partials[i] = env.partial(i, invals)
            return ()

        order = [i for i in self.order if i in plan.chain or i not in peep.skip]
        evaluate_eqns(eqns, order, _Kept(env, plan.passthrough), bind)
        parts = (
            [running[i] for i in plan.sources],
            [env.whole[u] for u in plan.shifts],
            [partials[i] for i in self.others],
        )
        return parts, [env.local[v] for v in region.surviving]

    def _running(self, i: int, part: Any, old: Any) -> Any:
        """Max sink ``i``'s running partials after this chunk: its own (``old`` None, or the
        first chunk of a :class:`chunk_loop.Started`), else folded into ``old``'s."""
        if old is None:
            return part
        eqn, reducer = self.graph.eqns[i], self.region.maps[i].reducer
        k = self.plan.sources.index(i)
        if isinstance(old, chunk_loop.Started):
            folded = reducer.fold(eqn, old.old[k], part)
            return chunk_loop.first_or_folded(old.first, part, folded)
        return reducer.fold(eqn, old[k], part)

    def _pass_through(self, invals: list[Any], i: int, n: int) -> Any:
        """A product with (or division by) a late factor: the kept operand, broadcast."""
        m = self.region.maps[i]
        out = self.graph.eqns[i].outvars[0]
        shape = list(out.aval.shape)
        shape[m.outs[0]] = n
        return jnp.broadcast_to(invals[self.plan.passthrough[i]], shape).astype(out.aval.dtype)


@dataclass(frozen=True)
class _Kept:
    """A chunk's values (:class:`memsafe.graph.interpret.Values`) where a pass-through product
    reads only the operand it keeps (the other, a late factor, is applied after the loop and
    is not one of its inputs)."""

    env: ChunkEnv
    kept: dict[int, int]

    def operands(self, i: int, eqn: JaxprEqn) -> list[Any]:
        k = self.kept.get(i)
        if k is None:
            return self.env.operands(i, eqn)
        ins = self.env.region.maps[i].ins
        return [self.env.read(a, ins[j]) if j == k else None for j, a in enumerate(eqn.invars)]

    def define(self, i: int, eqn: JaxprEqn, outs: Sequence[Any]) -> None:
        self.env.define(i, eqn, outs)


def late_factors(graph: Graph, region: Region, plan: OnlinePlan) -> Group:
    """The group that finishes an online region's deferred sinks: their accumulators times their
    late factors (what the loop leaves under :func:`raw_key`, and the late bases)."""

    def run(vals: list[Any]) -> list[Any]:
        accs, late = vals[: len(plan.deferred)], vals[len(plan.deferred) :]
        bases = dict(zip(plan.late, late))
        out = []
        for i, acc in zip(plan.deferred, accs):
            f = plan.factors[i].value(graph, bases)
            out.append(acc if f is None else acc * f.astype(acc.dtype))
        return out

    return Group(
        eqns=frozenset(),
        needs=(*(raw_key(i) for i in plan.deferred), *plan.late),
        gives=tuple(o for i in plan.deferred for o in graph.eqns[i].outvars),
        position=max(region.maps),
        run=run,
    )


def strategy(graph: Graph, region: Region) -> OnlineSplit | None:
    """The online strategy (``memsafe.split.planner.STRATEGIES``): the region as one online loop,
    or None where that does not apply (regions whose chunks cover other positions than their own,
    extended ones of :mod:`memsafe.split.strategies.halo`, run as plain staged loops)."""
    if not region.span.plain:
        return None
    try:
        return plan(graph, region)
    except NotOnline:
        return None


def plan(graph: Graph, region: Region) -> OnlineSplit:
    """The region as one online loop; raises :class:`NotOnline` where it does not apply."""
    if region.n_stages < 2:
        raise NotOnline("the region runs in one stage already")
    for i in region.maps:
        if region.running(graph, i) is not None:
            raise NotOnline(f"{graph.eqns[i].primitive.name} scans along the axis")
    online = analyse(graph, region)
    return OnlineSplit(region.one_stage(), online)
