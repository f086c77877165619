"""Unflatten: reshapes that merge axes are taken out of the way of splitting.

``jnp.argmax(s)`` over a whole matrix, ``s.reshape(-1).reshape(n, m)`` and ``jnp.sum(s.ravel())``
all flatten a large value first. The flat value has no axis a split can follow (a chunk of rows
is a run of the flat axis), so a split region stopped at the reshape. This pass rewrites:

* a reshape of a reshape as one reshape of the first operand (and no reshape at all when the
  shape comes back): ``s.reshape(-1).reshape(n, m)`` is ``s``;
* an elementwise operation on reshaped values as the operation before the reshape (the
  reshape moves after it), so that reshapes meet the reshapes and reductions above;
* a reduction over axes a reshape merged as the same reduction over the original axes
  (``reduce_sum``, ``reduce_max``, ... by :data:`MERGED_RULES`, one rule per primitive);
* ``argmax``/``argmin`` over a merged axis as one argmax per original axis, last axis first,
  each index combined with the ones before it: the first extreme in row-major order, for ties,
  NaN (the first NaN wins) and infinities alike, and the same index the flat argmax returns.

Loop bodies (scan, while) and cond branches are rewritten the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import LOOP_BODIES, ClosedJaxpr, JaxprEqn, Var, bind_eqn, bind_eqn_with, dce
from memsafe.context import PassContext
from memsafe.graph.bodies import runs_any, with_bodies
from memsafe.graph.interpret import retrace
from memsafe.plan import PassRecord
from memsafe.primitives import ELEMENTWISE

#: Axes of one side of a reshape that the other side's axes map onto as a block.
Group = tuple[tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Flat:
    """A reshape's result, remembered with the value it reshaped (before any earlier reshape)."""

    source: Any  # the traced operand of the first reshape of the chain
    shape: tuple[int, ...]  # its shape

    def groups(self, out_shape: tuple[int, ...]) -> list[Group] | None:
        return reshape_groups(self.shape, out_shape)


#: Its result does not depend on the attempt (the program alone decides what it rewrites):
#: run once per search (:class:`memsafe.passes.base.Pass`).
SCALE_FREE = True


def reshape_groups(src: Sequence[int], dst: Sequence[int]) -> list[Group] | None:
    """The blocks of a row-major reshape ``src -> dst``: (source axes, result axes) pairs whose
    sizes multiply to the same number, smallest blocks first. None for empty arrays."""
    if 0 in src or 0 in dst:
        return None
    groups: list[Group] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        i0, j0, p, q = i, j, 1, 1
        while True:
            if p <= q and i < len(src):
                p, i = p * src[i], i + 1
            elif j < len(dst):
                q, j = q * dst[j], j + 1
            else:
                break
            if p == q and (i == len(src) or src[i] != 1) and (j == len(dst) or dst[j] != 1):
                break
        if p != q:
            return None
        groups.append((tuple(range(i0, i)), tuple(range(j0, j))))
    return groups


def _merged(flat: Flat, out_shape: tuple[int, ...], axes: Sequence[int]) -> list[int] | None:
    """The source axes the result axes ``axes`` come from, when they are whole blocks of the
    reshape and at least one block merges two or more axes longer than one; else None."""
    groups = flat.groups(out_shape)
    if groups is None:
        return None
    wanted, source, merges = set(axes), [], False
    for src, dst in groups:
        hit = wanted & set(dst)
        if not hit:
            continue
        if hit != set(dst):
            return None
        source.extend(src)
        merges |= sum(flat.shape[a] > 1 for a in src) > 1
    return source if merges else None


# -- rules: a reduction over merged axes, computed on the unmerged operand ------------------------

#: (equation, unmerged operand, its source axes to reduce) -> the equation's results, or None
#: where the rule does not apply (the flat form is kept).
MergedRule = Callable[[JaxprEqn, Any, list[int]], list[Any] | None]

#: How each reduction runs over axes a reshape merged, by primitive name.
MERGED_RULES: dict[str, MergedRule] = {}


def merged_rule(*names: str) -> Callable[[MergedRule], MergedRule]:
    def deco(rule: MergedRule) -> MergedRule:
        for n in names:
            MERGED_RULES[n] = rule
        return rule

    return deco


@merged_rule("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or")
def _reduce_source_axes(eqn: JaxprEqn, x: Any, axes: list[int]) -> list[Any]:
    """The reduction over the source axes, reshaped to the merged result's shape."""
    (out,) = bind_eqn_with(eqn, [x], axes=tuple(axes))
    return [lax.reshape(out, tuple(eqn.outvars[0].aval.shape))]


def _at(values: Any, index: Any, axis: int) -> Any:
    """``values`` read at ``index`` along ``axis`` (``index`` lacks that axis): a masked sum
    over it, in lax alone (a gather through jnp would leave a nested jit in the program)."""
    shape = values.shape
    positions = lax.broadcasted_iota(index.dtype, shape, axis)
    wanted = lax.broadcast_in_dim(index, shape, [d for d in range(len(shape)) if d != axis])
    zero = lax.full_like(values, 0)
    return lax.reduce_sum(lax.select(lax.eq(positions, wanted), values, zero), (axis,))


def _arg_extreme(pick: Callable[..., Any], extreme: Callable[..., Any]) -> MergedRule:
    """An argmax/argmin over merged axes: ``pick`` along each source axis from the last, the
    ``extreme`` value carried to the next axis, and the indices combined row-major."""

    def rule(eqn: JaxprEqn, x: Any, axes: list[int]) -> list[Any] | None:
        if not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
            return None  # complex and boolean operands keep their flat form
        dtype = eqn.params["index_dtype"]
        values, index, stride = x, None, 1
        for ax in sorted(axes, reverse=True):
            chosen = pick(values, ax, dtype)
            index = chosen if index is None else chosen * stride + _at(index, chosen, ax)
            values = extreme(values, (ax,))
            stride *= x.shape[ax]
        return [lax.reshape(index, tuple(eqn.outvars[0].aval.shape))]

    return rule


MERGED_RULES["argmax"] = _arg_extreme(lax.argmax, lax.reduce_max)
MERGED_RULES["argmin"] = _arg_extreme(lax.argmin, lax.reduce_min)


def _reduced_axes(eqn: JaxprEqn) -> tuple[int, ...]:
    return tuple(eqn.params["axes"])


# -- the pass --------------------------------------------------------------------------------------


class _Unflatten:
    """The rewrite of one program: remembers each reshape's source as the program is traced."""

    def __init__(self) -> None:
        self.flat: dict[Var, Flat] = {}
        self.changes: list[str] = []

    def __call__(self, index: int, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        name = eqn.primitive.name
        if name == "reshape":
            return self._reshape(eqn, invals)
        if name in MERGED_RULES:
            return self._reduce(eqn)
        if name in ELEMENTWISE:
            return self._elementwise(eqn, invals)
        if name in LOOP_BODIES:
            return with_bodies(eqn, invals, lambda b: unflatten(b, self.changes))
        return None

    def _reshape(self, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        if eqn.params.get("dimensions") is not None or len(invals) != 1:
            return None
        atom, out_shape = eqn.invars[0], tuple(eqn.outvars[0].aval.shape)
        before = self.flat.get(atom) if isinstance(atom, Var) else None
        source = before or Flat(invals[0], tuple(atom.aval.shape))
        self.flat[eqn.outvars[0]] = source
        if before is None:
            return None
        self.changes.append(f"reshape {source.shape} -> {out_shape} in one step")
        if out_shape == source.shape:
            return [source.source]
        return [lax.reshape(source.source, out_shape)]

    def _elementwise(self, eqn: JaxprEqn, invals: list[Any]) -> list[Any] | None:
        """The operation on the reshapes' sources when every operand that is not a scalar is a
        reshape of a value of one shape; its results are reshaped after it."""
        flats = [self.flat.get(a) if isinstance(a, Var) else None for a in eqn.invars]
        scalar = [not a.aval.shape for a in eqn.invars]
        shapes = {f.shape for f in flats if f is not None}
        if len(shapes) != 1 or not all(f is not None or s for f, s in zip(flats, scalar)):
            return None
        (shape,) = shapes
        sources = [f.source if f is not None else v for f, v in zip(flats, invals)]
        outs = bind_eqn(eqn, sources)
        for var, out in zip(eqn.outvars, outs):
            self.flat[var] = Flat(out, shape)
        return [lax.reshape(o, tuple(v.aval.shape)) for o, v in zip(outs, eqn.outvars)]

    def _reduce(self, eqn: JaxprEqn) -> list[Any] | None:
        atom = eqn.invars[0]
        flat = self.flat.get(atom) if isinstance(atom, Var) else None
        if flat is None or len(eqn.invars) != 1:
            return None
        axes = _merged(flat, tuple(atom.aval.shape), _reduced_axes(eqn))
        outs = None if axes is None else MERGED_RULES[eqn.primitive.name](eqn, flat.source, axes)
        if outs is not None:
            self.changes.append(
                f"{eqn.primitive.name} over axes {axes} of {flat.shape} instead of the merged "
                f"{tuple(atom.aval.shape)}"
            )
        return outs


def unflatten(closed: ClosedJaxpr, changes: list[str]) -> ClosedJaxpr:
    """``closed`` with its reshape chains and merged reductions rewritten (itself if none is);
    what changed is appended to ``changes``."""
    if not runs_any(closed, ("reshape",)):
        return closed
    rewrite = _Unflatten()
    new = retrace(closed, rewrite)
    if not rewrite.changes:
        return closed
    changes.extend(rewrite.changes)
    return dce(new)


def run(closed: ClosedJaxpr, ctx: PassContext) -> ClosedJaxpr:
    """Rewrite reshapes that merge axes away from the program's reductions and reshapes."""
    changes: list[str] = []
    new = unflatten(closed, changes)
    for change in dict.fromkeys(changes):
        ctx.record(PassRecord("unflatten", change))
    return new


__all__ = ["MERGED_RULES", "reshape_groups", "run", "unflatten"]
