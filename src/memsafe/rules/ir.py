"""A canonical expression view of a jaxpr, the common ground on which rules are matched.

The same computation reaches a jaxpr in many spellings: ``x[:, None]`` is a ``broadcast_in_dim``
or a ``reshape``, ``d ** 2`` is ``integer_pow[y=2]``, ``square``, ``mul d d`` or ``pow d 2.0``, a
vmapped per-pair ``jnp.dot(d, d)`` is a ``dot_general`` with batch dimensions. This module folds
those spellings into one form:

* **Layout is not an operation.** ``broadcast_in_dim``, ``transpose``, unit-only ``reshape`` and
  ``squeeze``, ``tile`` of unit axes, same-dtype ``convert_element_type`` and ``copy`` are looked
  through: an operand is a :class:`View` of a :class:`Node`, saying for each of its axes which
  axis of the node it is, or ``None`` for a broadcast (or unit) axis. Axis *roles* survive;
  axis *order* and sizes do not matter.
* **Spellings are canonical.** squares become ``square``; ``dot_general`` with no free dimensions
  becomes ``reduce_sum(mul(a, b))``; ``add_any`` becomes ``add``.
* **Equal expressions are one node** (hash-consing), so ``(x - y) * (x - y)`` written twice is a
  square too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from memsafe._jax import ClosedJaxpr, JaxprEqn, Literal, Var
from memsafe.primitives import ELEMENTWISE

#: Parameters that do not change what a value is (placement, precision, accumulation hints).
IGNORED_PARAMS = frozenset(
    {"sharding", "out_sharding", "precision", "preferred_element_type", "accumulation_type"}
)


@dataclass(eq=False)
class Node:
    """One canonical operation (or a leaf: ``input`` or ``literal``) and its output shape."""

    uid: int
    op: str
    params: tuple[tuple[str, Any], ...]
    operands: tuple[View, ...]
    shape: tuple[int, ...]
    dtype: Any
    vars: list[Any] = field(default_factory=list)  # program variables holding this value
    eqns: set[int] = field(default_factory=set)  # equations computing it (several after CSE)
    value: Any = None  # a literal's value

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    @property
    def rank(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Node#{self.uid}({self.op}{list(self.shape)})"


@dataclass(frozen=True, eq=False)
class View:
    """A node seen through layout operations.

    ``amap[i]`` is the node axis that axis ``i`` of this view is, or ``None`` when axis ``i`` is
    a broadcast (or has size 1). ``eqns`` are the layout equations looked through.
    """

    node: Node
    amap: tuple[int | None, ...]
    shape: tuple[int, ...]
    eqns: frozenset[int] = frozenset()

    @property
    def rank(self) -> int:
        return len(self.shape)

    def key(self) -> tuple[int, tuple[int | None, ...], tuple[int, ...]]:
        return (self.node.uid, self.amap, self.shape)


def identity_amap(shape: tuple[int, ...]) -> tuple[int | None, ...]:
    return tuple(None if s == 1 else k for k, s in enumerate(shape))


def node_view(node: Node, eqns: frozenset[int] = frozenset()) -> View:
    return View(node, identity_amap(node.shape), node.shape, eqns)


def canon_value(v: Any) -> Any:
    """A hashable canonical form of a parameter value."""
    if isinstance(v, bool | str | type(None)):
        return v
    if isinstance(v, np.dtype):
        return v
    if isinstance(v, int | np.integer):
        return int(v)
    if isinstance(v, float | np.floating):
        return float(v)
    if isinstance(v, list | tuple):
        return tuple(canon_value(x) for x in v)
    if hasattr(v, "_asdict"):  # NamedTuples such as GatherDimensionNumbers
        return (type(v).__name__, canon_value(tuple(v._asdict().items())))
    try:
        hash(v)
        return v
    except TypeError:
        return ("<object>", id(v))


def canon_params(params: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted((k, canon_value(v)) for k, v in params.items() if k not in IGNORED_PARAMS))


def numeric_leaves(value: Any, path: tuple = ()) -> Iterable[tuple[tuple, Any]]:
    """(path, number) for every int/float inside a canonical parameter value."""
    if isinstance(value, bool):
        return
    if isinstance(value, int | float):
        yield path, value
    elif isinstance(value, tuple):
        for i, x in enumerate(value):
            yield from numeric_leaves(x, (*path, i))


def _unit_map(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[int] | None:
    """For a reshape that only inserts/removes unit axes: out axis -> in axis (-1 for units)."""
    ins = [k for k, s in enumerate(in_shape) if s != 1]
    outs = [k for k, s in enumerate(out_shape) if s != 1]
    if [in_shape[k] for k in ins] != [out_shape[k] for k in outs]:
        return None
    mapping = [-1] * len(out_shape)
    for i, o in zip(ins, outs):
        mapping[o] = i
    return mapping


class IR:
    """The canonical expression graph of one jaxpr, built lazily per variable."""

    def __init__(self, closed: ClosedJaxpr) -> None:
        self.closed = closed
        self.eqns: list[JaxprEqn] = list(closed.jaxpr.eqns)
        self.producer: dict[Var, int] = {}
        self._eqn_of: dict[Var, JaxprEqn] = {}  # the equation computing a var (maybe nested)
        for i, eqn in enumerate(self.eqns):
            for v in eqn.outvars:
                self.producer[v] = i
                self._eqn_of[v] = eqn
        self._views: dict[Any, View] = {}
        self._cse: dict[Any, Node] = {}
        self.nodes: list[Node] = []

    # -- construction ------------------------------------------------------------------------

    def build_all(self) -> IR:
        """Build every variable's view (needed before asking which equations compute a node)."""
        for eqn in self.eqns:
            for v in eqn.outvars:
                if isinstance(v, Var) and hasattr(v, "aval") and hasattr(v.aval, "shape"):
                    self.view(v)
        return self

    def _new(
        self,
        op: str,
        params: tuple,
        operands: tuple[View, ...],
        shape: tuple[int, ...],
        dtype: Any,
        key: Any,
        value: Any = None,
    ) -> Node:
        found = self._cse.get(key)
        if found is not None:
            return found
        node = Node(len(self.nodes), op, params, operands, shape, dtype, value=value)
        self.nodes.append(node)
        self._cse[key] = node
        return node

    def _leaf(self, atom: Any) -> Node:
        aval = atom.aval
        if isinstance(atom, Literal):
            value = np.asarray(atom.val)
            key = ("literal", value.dtype.str, value.tobytes(), value.shape)
            return self._new(
                "literal",
                (("value", canon_value(value.item()) if value.ndim == 0 else key),),
                (),
                tuple(aval.shape),
                aval.dtype,
                key,
                value=value,
            )
        node = self._new("input", (), (), tuple(aval.shape), aval.dtype, ("input", id(atom)))
        if atom not in node.vars:
            node.vars.append(atom)
        return node

    def view(self, atom: Any) -> View:
        """The canonical view of a variable or literal."""
        if isinstance(atom, Literal):
            node = self._leaf(atom)
            return node_view(node)
        found = self._views.get(atom)
        if found is not None:
            return found
        index = self.producer.get(atom)
        if index is None:
            result = node_view(self._leaf(atom))
        else:
            eqn = self._eqn_of[atom]
            result = self._layout(index, eqn)
            if result is None:
                inlined = self._platform_cond(index, eqn, atom)
                if inlined is not None:
                    self._views[atom] = inlined
                    return inlined
                node = self._node(index, eqn, eqn.outvars.index(atom))
                node.eqns.add(index)
                if atom not in node.vars:
                    node.vars.append(atom)
                result = node_view(node)
        self._views[atom] = result
        return result

    def _platform_cond(self, index: int, eqn: JaxprEqn, atom: Var) -> View | None:
        """A ``cond`` on ``platform_index`` (``jnp.diag`` of a square matrix emits one) is its
        default branch: look inside it, attributing its equations to the ``cond``."""
        if eqn.primitive.name != "cond" or "branches_platforms" not in eqn.params:
            return None
        platforms = eqn.params["branches_platforms"]
        branches = eqn.params["branches"]
        default = [i for i, p in enumerate(platforms) if p is None]
        if not default or len(branches) != len(platforms):
            return None
        branch = branches[default[0]]
        jaxpr = branch.jaxpr
        if jaxpr.constvars or branch.consts:
            return None
        for inner, outer in zip(jaxpr.invars, eqn.invars[1:]):
            self._views[inner] = self.view(outer)
        for sub in jaxpr.eqns:
            for v in sub.outvars:
                self.producer[v] = index
                self._eqn_of[v] = sub
        result = self.view(jaxpr.outvars[eqn.outvars.index(atom)])
        node = result.node
        if node.op not in ("input", "literal"):
            node.eqns.add(index)
            if atom not in node.vars and result.amap == identity_amap(node.shape):
                node.vars.append(atom)
        return View(node, result.amap, result.shape, result.eqns | {index})

    def _layout(self, index: int, eqn: JaxprEqn) -> View | None:
        """The view through a layout equation, or None when ``eqn`` computes something."""
        name = eqn.primitive.name
        if len(eqn.outvars) != 1 or not eqn.invars:
            return None
        out_shape = tuple(eqn.outvars[0].aval.shape)
        operand = eqn.invars[0]
        in_shape = tuple(operand.aval.shape)
        p = eqn.params
        mapping: list[int] | None  # out axis -> operand axis, -1 for a new/broadcast axis
        if name == "broadcast_in_dim":
            if len(eqn.invars) != 1:
                return None
            mapping = [-1] * len(out_shape)
            for k, d in enumerate(p["broadcast_dimensions"]):
                mapping[int(d)] = k if in_shape[k] == out_shape[int(d)] else -1
        elif name == "transpose":
            mapping = [int(a) for a in p["permutation"]]
        elif name in ("reshape", "squeeze"):
            if name == "reshape" and p.get("dimensions") is not None:
                return None
            mapping = _unit_map(in_shape, out_shape)
        elif name == "tile":
            reps = [int(r) for r in p["reps"]]
            if len(reps) != len(in_shape) or any(r != 1 and s != 1 for r, s in zip(reps, in_shape)):
                return None
            mapping = [k if r == 1 else -1 for k, r in enumerate(reps)]
        elif name == "convert_element_type":
            if np.dtype(p["new_dtype"]) != np.dtype(operand.aval.dtype):
                return None
            mapping = list(range(len(out_shape)))
        elif name in ("copy", "copy_p"):
            mapping = list(range(len(out_shape)))
        else:
            return None
        if mapping is None:
            return None
        inner = self.view(operand)
        amap = tuple(
            None if (m < 0 or out_shape[j] == 1) else inner.amap[m] for j, m in enumerate(mapping)
        )
        return View(inner.node, amap, out_shape, inner.eqns | {index})

    def _node(self, index: int, eqn: JaxprEqn, out_index: int) -> Node:
        name = eqn.primitive.name
        out = eqn.outvars[out_index]
        shape = tuple(out.aval.shape)
        dtype = out.aval.dtype
        operands = [self.view(a) for a in eqn.invars]
        params = canon_params(eqn.params)
        if name in ELEMENTWISE:
            operands = [_broadcast_scalar(o, shape) for o in operands]
        if name == "add_any":
            name = "add"
        is_square = (
            (name == "integer_pow" and int(eqn.params["y"]) == 2)
            or (name == "pow" and _is_literal(operands[1], 2.0))
            or (name == "mul" and operands[0].key() == operands[1].key())
        )
        if is_square:
            name, params, operands = "square", (), operands[:1]
        elif name == "dot_general":
            virtual = self._dot_as_reduce(index, eqn, operands, shape, dtype)
            if virtual is not None:
                return virtual
        if len(eqn.outvars) > 1:
            params = (*params, ("__out__", out_index))
        key = (name, params, tuple(o.key() for o in operands))
        return self._new(name, params, tuple(operands), shape, dtype, key)

    def _dot_as_reduce(
        self, index: int, eqn: JaxprEqn, operands: list[View], shape: tuple, dtype: Any
    ) -> Node | None:
        """``dot_general`` with no free dimensions is ``reduce_sum(mul(a, b))`` over contraction."""
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        lhs, rhs = operands
        if len(lb) + len(lc) != lhs.rank or len(rb) + len(rc) != rhs.rank:
            return None
        order_l = [int(a) for a in (*lb, *lc)]
        order_r = [int(a) for a in (*rb, *rc)]
        lv = View(
            lhs.node,
            tuple(lhs.amap[a] for a in order_l),
            tuple(lhs.shape[a] for a in order_l),
            lhs.eqns,
        )
        rv = View(
            rhs.node,
            tuple(rhs.amap[a] for a in order_r),
            tuple(rhs.shape[a] for a in order_r),
            rhs.eqns,
        )
        full = lv.shape
        if lv.key() == rv.key():
            key = ("square", (), (lv.key(),))
            prod = self._new("square", (), (lv,), full, dtype, key)
        else:
            key = ("mul", (), (lv.key(), rv.key()))
            prod = self._new("mul", (), (lv, rv), full, dtype, key)
        prod.eqns.add(index)
        axes = tuple(range(len(lb), len(full)))
        params = (("axes", axes),)
        pv = node_view(prod)
        key = ("reduce_sum", params, (pv.key(),))
        return self._new("reduce_sum", params, (pv,), shape, dtype, key)


def _broadcast_scalar(view: View, shape: tuple[int, ...]) -> View:
    if view.rank == len(shape) or view.rank != 0:
        return view
    return View(view.node, (None,) * len(shape), shape, view.eqns)


def _is_literal(view: View, value: float) -> bool:
    node = view.node
    return (
        node.op == "literal"
        and node.value is not None
        and node.value.size == 1
        and float(node.value.reshape(())) == float(value)
    )
