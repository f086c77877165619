"""Cheaper chunk bodies: factors of a contraction applied to its smaller side.

A chunk body materializes every operand and result of a contraction (XLA's CPU backend does not
fuse elementwise work into dots). Two exact-up-to-rounding moves save a full pass over the
largest chunk values of attention-like bodies:

- ``(a @ b) * c`` / ``(a @ b) / c`` with a scalar ``c`` (the ``1/sqrt(d)`` of attention scores):
  ``c`` is applied to the smaller operand instead of the product;
- ``(x / f) @ v`` / ``(x * f) @ v`` where ``f`` is constant along the contracted axes (the softmax
  normalization ``e / sum(e)``): the product ``x @ v`` is scaled by ``f`` carried to its layout
  (Rabe & Staats normalize the attention output, not the weights).

Only values used once, inside the loop, are rewritten.

One more move mirrors XLA: ``x / s`` with a loop-invariant scalar ``s`` becomes ``x * (1 / s)``.
XLA rewrites a division by a broadcast value this way in a flat program (what jax.jit runs) but
not inside a while body whose divisor is carried (measured on jax 0.10.2's CPU backend), where
the per-element divide cost the Gaussian-kernel matvec 5% of its time.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn, Literal, is_var
from memsafe.graph import Graph
from memsafe.split.region import Region
from memsafe.split.registry import Mapping, rebind

Read = Callable[[Any, Any], Any]  # (atom, axis or None) -> value in the chunk body


@dataclass(frozen=True)
class Scale:
    """The scalar of ``scaler`` (a mul/div of the dot's result) moved onto dot operand
    ``operand``."""

    scaler: int
    operand: int
    scalar: Any
    op: str


@dataclass(frozen=True)
class Norm:
    """Dot operand ``operand`` is ``x op f`` (eqn ``scaler``): the dot reads ``x`` and its result
    is scaled by ``f`` (``op`` "mul") or divided by it ("div")."""

    scaler: int
    operand: int
    x: Any
    x_axis: Any
    f: Any
    f_axis: Any
    op: str


@dataclass
class Peepholes:
    scale: dict[int, Scale]
    norm: dict[int, dict[int, Norm]]
    skip: set[int]

    def bind(self, i: int, eqn: JaxprEqn, invals: list[Any], read: Read, run: Callable) -> list:
        """Results of dot ``i`` (``run`` binds it at chunk shape) with its moved factors."""
        invals = list(invals)
        norms = self.norm.get(i, {})
        for k, nm in norms.items():
            invals[k] = read(nm.x, nm.x_axis)
        s = self.scale.get(i)
        if s is not None:
            c = s.scalar.val if isinstance(s.scalar, Literal) else read(s.scalar, None)
            v = invals[s.operand]
            invals[s.operand] = (
                lax.mul(v, _cast(c, v)) if s.op == "mul" else lax.div(v, _cast(c, v))
            )
        (out,) = run(invals)
        for k, nm in norms.items():
            f = read(nm.f, nm.f_axis)
            rank = len(eqn.invars[k].aval.shape)
            if f.ndim != rank:
                f = jnp.reshape(f, (1,) * rank)
            if nm.op == "div":
                f = 1.0 / f
            out = out * _carry(eqn, k, f).astype(out.dtype)
        return [out]


def _cast(c: Any, like: Any) -> Any:
    return jnp.asarray(c, dtype=like.dtype)


def _carry(eqn: JaxprEqn, k: int, f: Any) -> Any:
    """``f`` (constant along operand ``k``'s contracted axes) in the layout of the result."""
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    other = eqn.invars[1 - k]
    ones = jnp.ones((1,) * len(other.aval.shape), f.dtype)
    fa, fb = (f, ones) if k == 0 else (ones, f)
    sa, sb = list(fa.shape), list(fb.shape)
    for a, b in zip(lb, rb):
        sa[a] = sb[b] = max(sa[a], sb[b])
    fa, fb = jnp.broadcast_to(fa, sa), jnp.broadcast_to(fb, sb)
    return lax.dot_general(fa, fb, ((lc, rc), (lb, rb)))


@dataclass
class _Finder:
    """The search for peepholes among a loop body's equations."""

    graph: Graph
    region: Region
    members: set[int]
    chunk: int
    scale: dict[int, Scale] = field(default_factory=dict)
    norm: dict[int, dict[int, Norm]] = field(default_factory=dict)
    skip: set[int] = field(default_factory=set)

    def once(self, var: Any) -> int | None:
        """The single in-loop consumer of a region value used nowhere else, or None."""
        info = self.graph.info(var)
        if var in self.region.surviving or info.is_output or len(info.consumers) != 1:
            return None
        c = info.consumers[0]
        return c if c in self.members else None

    def is_dot(self, i: int) -> bool:
        eqn = self.graph.eqns[i]
        return (
            eqn.primitive.name == "dot_general"
            and isinstance(self.region.maps[i], Mapping)
            and len(eqn.outvars) == 1
        )

    def elems(self, i: int, k: int) -> float:
        atom = self.graph.eqns[i].invars[k]
        n = float(math.prod(atom.aval.shape))
        return n * self.chunk / self.region.size if self.region.maps[i].ins[k] is not None else n

    def operand_factors(self, i: int) -> None:
        """Factors of dot ``i``'s operands constant along the contraction (``(x / f) @ v``)."""
        eqns = self.graph.eqns
        (lc, rc), _ = eqns[i].params["dimension_numbers"]
        for k, contracted in ((0, lc), (1, rc)):
            y = eqns[i].invars[k]
            if not is_var(y) or y not in self.region.produced:
                continue
            p = self.graph.info(y).producer
            if p is None or p not in self.members or self.once(y) != i or p in self.skip:
                continue
            found = self._factor_of(p, y, contracted)
            if found is not None:
                xi, fi = found
                s, sm = eqns[p], self.region.maps[p]
                x, f = s.invars[xi], s.invars[fi]
                nm = Norm(p, k, x, sm.ins[xi], f, sm.ins[fi], s.primitive.name)
                self.norm.setdefault(i, {})[k] = nm
                self.skip.add(p)

    def _factor_of(self, p: int, y: Any, contracted: Any) -> tuple[int, int] | None:
        """(value, factor) operand positions of ``y = x * f`` or ``x / f`` with ``f`` a float
        scalar or an array constant along ``contracted``; None if ``y`` is not such a product."""
        s = self.graph.eqns[p]
        if s.primitive.name not in ("mul", "div") or s.outvars[0].aval.dtype != y.aval.dtype:
            return None
        shape = tuple(y.aval.shape)
        for xi, fi in [(0, 1)] if s.primitive.name == "div" else [(0, 1), (1, 0)]:
            x, f = s.invars[xi], s.invars[fi]
            if isinstance(x, Literal) or isinstance(f, Literal):
                continue
            fshape = tuple(f.aval.shape)
            if tuple(x.aval.shape) != shape or len(fshape) not in (0, len(shape)):
                continue
            if fshape and any(fshape[d] != 1 for d in contracted):
                continue
            if jnp.issubdtype(f.aval.dtype, jnp.floating):
                return xi, fi
        return None

    def product_scalar(self, i: int) -> None:
        """A scalar multiplying (or dividing) dot ``i``'s product, moved to a smaller operand."""
        eqns, maps = self.graph.eqns, self.region.maps
        eqn = eqns[i]
        j = self.once(eqn.outvars[0])
        if j is None or j in self.skip:
            return
        s = eqns[j]
        if s.primitive.name not in ("mul", "div") or s.outvars[0].aval != eqn.outvars[0].aval:
            return
        pos = list(s.invars).index(eqn.outvars[0])
        c = s.invars[1 - pos]
        if (s.primitive.name == "div" and pos != 0) or not _invariant_float_scalar(c, self.region):
            return
        # the operand sliced per chunk (its scaling fuses with the slice, no new whole buffer),
        # else the smaller one; only when it is much smaller than the product
        out_elems = math.prod(eqn.outvars[0].aval.shape) * self.chunk / self.region.size
        sides = sorted((0, 1), key=lambda k: (maps[i].ins[k] is None, self.elems(i, k)))
        moved = self.norm.get(i, {})
        sides = [k for k in sides if k not in moved and 8 * self.elems(i, k) <= out_elems]
        if sides:
            self.scale[i] = Scale(j, sides[0], c, s.primitive.name)
            self.skip.add(j)


def _invariant_float_scalar(c: Any, region: Region) -> bool:
    if len(getattr(c.aval, "shape", ())) != 0 or not jnp.issubdtype(c.aval.dtype, jnp.floating):
        return False
    return not (is_var(c) and c in region.produced)


def plan(graph: Graph, region: Region, idx: list[int] | tuple[int, ...], chunk: int) -> Peepholes:
    """The moves that apply among the loop body's equations ``idx``."""
    finder = _Finder(graph, region, set(idx), chunk)
    for i in idx:
        if finder.is_dot(i):
            finder.operand_factors(i)
            finder.product_scalar(i)
    return Peepholes(finder.scale, finder.norm, finder.skip)


def bind_mapped(
    peep: Peepholes,
    i: int,
    eqn: JaxprEqn,
    invals: list[Any],
    m: Mapping,
    read: Callable[..., Any],
    local: dict[Any, Any],
    eqns: list[JaxprEqn],
    start: Any,
    n: int,
) -> list[Any]:
    """Equation ``i`` of a loop body at chunk shape: through its peephole where one applies
    (recording the moved scalar's value in ``local``), else re-bound by its axis rule."""
    if i in peep.scale or i in peep.norm:
        outs = peep.bind(i, eqn, invals, read, lambda v: rebind(eqn, v, m, start, n))
        if i in peep.scale:
            local[eqns[peep.scale[i].scaler].outvars[0]] = outs[0]
        return outs
    if _divides_by_invariant_scalar(eqn, m):
        x, s = invals
        return [lax.mul(x, lax.div(jnp.ones((), s.dtype), s))]
    return rebind(eqn, invals, m, start, n)


#: Dtypes whose division XLA turns into a multiplication by the reciprocal in that dtype (smaller
#: floats are computed in float32 by XLA's CPU backend, so the move would round differently).
_RECIPROCAL_DTYPES = (jnp.float32, jnp.float64)


def _divides_by_invariant_scalar(eqn: JaxprEqn, m: Mapping) -> bool:
    """``eqn`` divides a chunked value by a scalar variable read whole from outside the loop."""
    if eqn.primitive.name != "div" or m.ins[0] is None or m.ins[1] is not None:
        return False
    s = eqn.invars[1]
    return (
        not isinstance(s, Literal)
        and len(s.aval.shape) == 0
        and any(s.aval.dtype == d for d in _RECIPROCAL_DTYPES)
    )
