"""The rule API: a pattern and its replacement, two plain JAX functions.

A :class:`Rule` traces its pattern into the canonical expression form of :mod:`memsafe.rules.ir`
and matches it structurally against a program, the way torch.fx's ``replace_pattern`` does, with
three differences that matter for array code:

* **Shapes are symbolic.** The pattern is traced at two size assignments; sizes in parameters and
  literals (an ``iota``'s length, ``mean``'s ``1/n``) become expressions of dimension symbols, and
  a match unifies the symbols with the program's sizes. A pattern traced at ``"n d, m d"`` matches
  every ``n``, ``m``, ``d`` -- with ``d`` the same for both inputs.
* **Axis roles, not axis order.** Layout (broadcasts, transposes, unit reshapes) is looked through,
  so ``x[:, None] - y[None]`` matches a vmap-of-vmap per-pair function; a matched input is handed
  to the replacement transposed back into the pattern's axis order.
* **Batched variants come for free.** With ``batched=True`` the rule also matches the pattern
  vmapped over a leading axis of any non-empty subset of its inputs.

An intermediate of a match that is used outside it blocks the rewrite, as in torch.fx.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memsafe._jax import Var
from memsafe.graph import Graph, inline_calls
from memsafe.primitives import COMMUTATIVE, CUMULATIVE, ELEMENTWISE, REDUCTIONS
from memsafe.rules import symbols as sym
from memsafe.rules.ir import (
    IR,
    Node,
    View,
    numeric_leaves,
)

#: A filter sees a candidate match and says whether the rule may fire there.
Filter = Callable[["Match"], bool]

_BATCH = "__batch__"


def _category(dtype: Any) -> Any:
    for cat in (jnp.bool_, jnp.floating, jnp.complexfloating, jnp.integer):
        if jnp.issubdtype(dtype, cat):
            return cat
    return None


@dataclass
class Match:
    """Where a rule matched: the root variable, the program values bound to the pattern inputs
    (with the permutation that puts them back in the pattern's axis order), and the region."""

    variant: Variant
    root: Var
    root_index: int
    args: list[tuple[Any, tuple[int, ...]]]  # (program Var or literal value, permutation)
    region: frozenset[int]
    sizes: dict[str, int]
    avals: list[jax.ShapeDtypeStruct]  # the replacement's arguments, in pattern axis order

    @property
    def rule(self) -> Rule:
        return self.variant.rule

    def arguments(self, read: Callable[[Any], Any]) -> list[Any]:
        """The replacement's arguments, given how to read a program variable's value."""
        out = []
        for atom, perm in self.args:
            value = read(atom) if isinstance(atom, Var) else jnp.asarray(atom)
            if perm != tuple(range(len(perm))):
                value = jnp.transpose(value, perm)
            out.append(value)
        return out


class _State:
    """Bindings so far in one branch of the backtracking match."""

    __slots__ = ("bound", "deferred", "internal", "leaves")

    def __init__(self) -> None:
        self.bound: dict[int, tuple[Node, tuple[int, ...]]] = {}
        self.deferred: list[tuple[sym.SizeExpr, float]] = []
        self.leaves: set[int] = set()  # ids of program nodes bound to pattern inputs
        self.internal: set[int] = set()  # ids of program nodes matched by pattern operations

    def copy(self) -> _State:
        new = _State()
        new.bound = dict(self.bound)
        new.deferred = list(self.deferred)
        new.leaves = set(self.leaves)
        new.internal = set(self.internal)
        return new


@dataclass
class Variant:
    """One traced form of a rule: a pattern alternative, possibly vmapped."""

    rule: Rule
    label: str
    pattern: Callable[..., Any]
    replacement: Callable[..., Any]
    specs: list[tuple[sym.AxisSpec, ...]]
    dtypes: list[Any]
    ir: IR = field(init=False)
    root: View = field(init=False)
    inputs: list[Node] = field(init=False)
    size: int = field(init=False)
    sizes: dict[str, int] = field(init=False)  # the sizes it was traced at

    def __post_init__(self) -> None:
        """Traced at one set of sizes (its operations, :func:`required_ops`); the second trace,
        which finds how its parameters follow the sizes (:attr:`syms`), runs on first use, or
        now where the rule checks its replacement (a user's rule, refused when first traced)."""
        sizes_a = sym.assign(self.specs, sym.PRIMES_A)
        # the second trace runs later, perhaps under another precision (jax.enable_x64),
        # where a pattern may trace to other operations: it is made under this one
        self._x64 = bool(jax.config.jax_enable_x64)
        self.ir, self.root, self.inputs = self._trace(sizes_a)
        self.size = len(self.ir.nodes)
        self.sizes = sizes_a
        self._syms: dict[int, dict[tuple, sym.SizeExpr]] | None = None
        if self.rule.check_replacement:
            self._syms = self._solve_syms()
            self.check_not_self_matching()

    @property
    def syms(self) -> dict[int, dict[tuple, sym.SizeExpr]]:
        """Per pattern node, its size-dependent parameters as expressions of the sizes (traced
        at a second set of sizes on first use: a form a program cannot match costs one trace).

        Raises:
            ValueError: the pattern's structure, or a parameter, follows the sizes in a way
                memsafe cannot express.
        """
        if self._syms is None:
            self._syms = self._solve_syms()
        return self._syms

    def _solve_syms(self) -> dict[int, dict[tuple, sym.SizeExpr]]:
        sizes_a, ir_a = self.sizes, self.ir
        sizes_b = sym.assign(self.specs, sym.PRIMES_B)
        with jax.enable_x64(self._x64):
            ir_b, _, _ = self._trace(sizes_b)
        if len(ir_a.nodes) != len(ir_b.nodes) or any(
            a.op != b.op for a, b in zip(ir_a.nodes, ir_b.nodes)
        ):
            raise ValueError(
                f"rule {self.rule.name!r} ({self.label}): the pattern's structure changes with "
                "its sizes; give each independent dimension its own name in `shapes`"
            )
        syms: dict[int, dict[tuple, sym.SizeExpr]] = {}
        for a, b in zip(ir_a.nodes, ir_b.nodes):
            leaves_b = dict(numeric_leaves(b.params))
            found: dict[tuple, sym.SizeExpr] = {}
            for path, va in numeric_leaves(a.params):
                vb = leaves_b.get(path)
                if vb is None or vb == va:
                    continue
                expr = sym.solve(float(va), float(vb), sizes_a, sizes_b)
                if expr is None:
                    raise ValueError(
                        f"rule {self.rule.name!r}: a parameter of {a.op} depends on the sizes "
                        f"in a way memsafe cannot express ({va} vs {vb})"
                    )
                found[path] = expr
            if found:
                syms[a.uid] = found
        return syms

    def check_not_self_matching(self) -> None:
        """Raise ValueError if the pattern matches (part of) the replacement, which would be
        rewritten again and again."""
        args = [
            jax.ShapeDtypeStruct(sym.concrete(s, self.sizes), d)
            for s, d in zip(self.specs, self.dtypes)
        ]
        try:
            closed = inline_calls(jax.make_jaxpr(self.replacement)(*args))
        except Exception as err:
            raise ValueError(
                f"rule {self.rule.name!r}: could not trace the replacement ({self.label}) at "
                f"{[a.shape for a in args]}: {err}"
            ) from err
        program = IR(closed).build_all()
        graph = Graph(closed)
        for eqn in closed.jaxpr.eqns:
            for v in eqn.outvars:
                if hasattr(v.aval, "shape") and self.match(program, graph, v) is not None:
                    raise ValueError(
                        f"rule {self.rule.name!r}: the pattern matches (part of) its own "
                        "replacement, so the rule would fire forever"
                    )

    def _trace(self, sizes: dict[str, int]) -> tuple[IR, View, list[Node]]:
        args = [
            jax.ShapeDtypeStruct(sym.concrete(s, sizes), d) for s, d in zip(self.specs, self.dtypes)
        ]
        try:
            closed = jax.make_jaxpr(self.pattern)(*args)
        except Exception as err:
            raise ValueError(
                f"rule {self.rule.name!r}: could not trace the pattern ({self.label}) at "
                f"{[a.shape for a in args]}: {err}"
            ) from err
        closed = inline_calls(closed)
        if len(closed.jaxpr.outvars) != 1:
            raise ValueError(f"rule {self.rule.name!r}: a pattern must return one array")
        ir = IR(closed).build_all()
        root = ir.view(closed.jaxpr.outvars[0])
        inputs = [ir.view(v).node for v in closed.jaxpr.invars]
        if root.node.op in ("input", "literal"):
            raise ValueError(f"rule {self.rule.name!r}: the pattern computes nothing")
        return ir, root, inputs

    # -- matching ----------------------------------------------------------------------------

    def match(self, program: IR, graph: Graph, var: Var) -> Match | None:
        """A match of this variant whose output is ``var``, or None."""
        gv = program.view(var)
        if gv.rank != self.root.rank or gv.node.op != self.root.node.op:
            return None
        ident = tuple(range(gv.rank))
        for state in self._view(self.root, gv, ident, _State()):
            found = self._finish(state, program, graph, var)
            if found is not None:
                return found
        return None

    def _finish(self, st: _State, program: IR, graph: Graph, root: Var) -> Match | None:
        sizes: dict[str, int] = {}
        args: list[tuple[Any, tuple[int, ...]]] = []
        avals = []
        for node, spec, dtype in zip(self.inputs, self.specs, self.dtypes):
            bound = st.bound.get(node.uid)
            if bound is None:
                return None  # an input the pattern does not use
            gnode, perm = bound
            for k, a in enumerate(spec):
                size = gnode.shape[perm[k]]
                if isinstance(a, int):
                    if size != a:
                        return None
                elif sizes.setdefault(a, size) != size:
                    return None
            gdtype = gnode.dtype
            if self.rule.dtypes is None:
                if _category(gdtype) is not _category(dtype):
                    return None
            elif not any(jnp.issubdtype(gdtype, c) for c in self.rule.dtypes):
                return None
            if gnode.op == "literal":
                atom: Any = gnode.value
            elif gnode.vars:
                atom = gnode.vars[0]
            else:
                return None
            args.append((atom, perm))
            avals.append(
                jax.ShapeDtypeStruct(tuple(gnode.shape[p] for p in perm), np.dtype(gdtype))
            )
        for expr, value in st.deferred:
            if len(expr.factors) == 1 and not expr.inverse and expr.factors[0] not in sizes:
                sizes[expr.factors[0]] = int(value)
            if any(f not in sizes for f in expr.factors):
                return None
            if not np.isclose(expr.evaluate(sizes), value, rtol=1e-6):
                return None
        region = _region(program, st, root)
        root_index = program.producer.get(root)
        if root_index is None or not _contained(graph, region, root):
            return None
        found = Match(self, root, root_index, args, region, sizes, avals)
        if not all(f(found) for f in self.rule.filters):
            return None
        try:
            out = jax.eval_shape(self.replacement, *avals)
        except Exception:
            return None
        if not isinstance(out, jax.ShapeDtypeStruct) or out.shape != tuple(root.aval.shape):
            return None
        if np.dtype(out.dtype) != np.dtype(root.aval.dtype):
            return None
        return found

    def _view(self, pv: View, gv: View, sigma: Sequence[int], st: _State) -> Iterator[_State]:
        """Match view ``pv`` with ``gv`` where pattern axis i is program axis ``sigma[i]``."""
        if pv.rank != gv.rank:
            return
        pn, gn = pv.node, gv.node
        if pn.rank != gn.rank:
            return
        node_sigma: dict[int, int] = {}
        for i in range(pv.rank):
            pa, ga = pv.amap[i], gv.amap[sigma[i]]
            if (pa is None) != (ga is None):
                return
            if pa is None:
                continue
            if node_sigma.setdefault(pa, ga) != ga:
                return
        if len(set(node_sigma.values())) != len(node_sigma):
            return
        rest_p = [k for k in range(pn.rank) if k not in node_sigma]
        used = set(node_sigma.values())
        rest_g = [k for k in range(gn.rank) if k not in used]
        if any(pn.shape[k] != 1 for k in rest_p) or any(gn.shape[k] != 1 for k in rest_g):
            return
        node_sigma.update(zip(rest_p, rest_g))
        ns = tuple(node_sigma[k] for k in range(pn.rank))
        yield from self._node(pn, gn, ns, st)

    def _node(self, pn: Node, gn: Node, ns: tuple[int, ...], st: _State) -> Iterator[_State]:
        prev = st.bound.get(pn.uid)
        if prev is not None:
            if prev[0] is gn and prev[1] == ns:
                yield st
            return
        if pn.op == "input":
            st = st.copy()
            st.bound[pn.uid] = (gn, ns)
            st.leaves.add(id(gn))
            yield st
            return
        if gn.op != pn.op:
            return
        st = st.copy()
        st.bound[pn.uid] = (gn, ns)
        if pn.op == "literal":
            if not self._params(pn, gn, st, ()):
                return
            yield st
            return
        st.internal.add(id(gn))
        op = pn.op
        if op in ELEMENTWISE:
            if not self._params(pn, gn, st, ()):
                return
            orders = [tuple(gn.operands)]
            if op in COMMUTATIVE and len(gn.operands) == 2:
                orders.append(tuple(reversed(gn.operands)))
            for gops in orders:
                yield from self._all(list(zip(pn.operands, gops, [ns] * len(gops))), st)
        elif op in REDUCTIONS:
            yield from self._reduce(pn, gn, ns, st)
        elif op in CUMULATIVE:
            pa, ga = int(pn.param("axis")), int(gn.param("axis"))
            if ns[pa] != ga or not self._params(pn, gn, st, ("axis",)):
                return
            yield from self._all([(pn.operands[0], gn.operands[0], ns)], st)
        elif op == "dot_general":
            yield from self._dot(pn, gn, ns, st)
        else:
            if ns != tuple(range(len(ns))) or len(pn.operands) != len(gn.operands):
                return
            if not self._params(pn, gn, st, ()):
                return
            pairs = [(p, g, tuple(range(p.rank))) for p, g in zip(pn.operands, gn.operands)]
            yield from self._all(pairs, st)

    def _all(self, pairs: list[tuple[View, View, Sequence[int]]], st: _State) -> Iterator[_State]:
        if not pairs:
            yield st
            return
        (pv, gv, sigma), rest = pairs[0], pairs[1:]
        for st2 in self._view(pv, gv, sigma, st):
            yield from self._all(rest, st2)

    def _params(self, pn: Node, gn: Node, st: _State, skip: tuple[str, ...]) -> bool:
        """Compare parameters; size-dependent leaves are deferred until sizes are known."""
        pp = {k: v for k, v in pn.params if k not in skip}
        gp = {k: v for k, v in gn.params if k not in skip}
        if pp.keys() != gp.keys():
            return False
        symbolic = self.syms.get(pn.uid, {})
        keys = [k for k, _ in pn.params]
        for name in pp:
            index = keys.index(name)
            sym_paths = {p[2:]: e for p, e in symbolic.items() if p[:2] == (index, 1)}
            if not _same(pp[name], gp[name], sym_paths, (), st):
                return False
        return True

    def _reduce(self, pn: Node, gn: Node, ns: tuple[int, ...], st: _State) -> Iterator[_State]:
        p_axes = [int(a) for a in pn.param("axes", ())]
        g_axes = [int(a) for a in gn.param("axes", ())]
        if len(p_axes) != len(g_axes) or not self._params(pn, gn, st, ("axes",)):
            return
        pop, gop = pn.operands[0], gn.operands[0]
        if pop.rank != gop.rank:
            return
        p_kept = [k for k in range(pop.rank) if k not in p_axes]
        g_kept = [k for k in range(gop.rank) if k not in g_axes]
        base = [0] * pop.rank
        for i, k in enumerate(p_kept):
            base[k] = g_kept[ns[i]]
        for perm in itertools.permutations(g_axes):
            sigma = list(base)
            for pa, ga in zip(p_axes, perm):
                sigma[pa] = ga
            yield from self._all([(pop, gop, sigma)], st)

    def _dot(self, pn: Node, gn: Node, ns: tuple[int, ...], st: _State) -> Iterator[_State]:
        (plc, prc), (plb, prb) = pn.param("dimension_numbers")
        (glc, grc), (glb, grb) = gn.param("dimension_numbers")
        if len(plc) != len(glc) or len(plb) != len(glb):
            return
        p_roles = _dot_roles(pn)
        g_roles = _dot_roles(gn)
        for swap in (False, True):
            gx, gy = (gn.operands[1], gn.operands[0]) if swap else gn.operands
            xb, yb = (grb, glb) if swap else (glb, grb)
            xc, yc = (grc, glc) if swap else (glc, grc)
            mine, other = ("r", "l") if swap else ("l", "r")
            if gx.rank != pn.operands[0].rank or gy.rank != pn.operands[1].rank:
                continue
            sig_l = [-1] * gx.rank
            sig_r = [-1] * gy.rank
            ok = True
            for i, (role, pos) in enumerate(p_roles):
                grole, gpos = g_roles[ns[i]]
                if role == "b" and grole == "b":
                    sig_l[int(plb[pos])] = int(xb[gpos])
                    sig_r[int(prb[pos])] = int(yb[gpos])
                elif role == "l" and grole == mine:
                    sig_l[pos] = gpos
                elif role == "r" and grole == other:
                    sig_r[pos] = gpos
                else:
                    ok = False
                    break
            if not ok:
                continue
            pairs = list(zip(xc, yc))
            for perm in itertools.permutations(pairs):
                sl, sr = list(sig_l), list(sig_r)
                for t, (gxa, gya) in enumerate(perm):
                    sl[int(plc[t])] = int(gxa)
                    sr[int(prc[t])] = int(gya)
                if -1 in sl or -1 in sr:
                    continue
                yield from self._all([(pn.operands[0], gx, sl), (pn.operands[1], gy, sr)], st)


def _dot_roles(node: Node) -> list[tuple[str, int]]:
    """Each output axis of a dot_general: ('b', batch index), ('l', lhs axis), ('r', rhs axis)."""
    (lc, rc), (lb, rb) = node.param("dimension_numbers")
    lhs, rhs = node.operands
    roles: list[tuple[str, int]] = [("b", i) for i in range(len(lb))]
    roles += [("l", a) for a in range(lhs.rank) if a not in lc and a not in lb]
    roles += [("r", a) for a in range(rhs.rank) if a not in rc and a not in rb]
    return roles


def _same(p: Any, g: Any, sym_paths: dict[tuple, sym.SizeExpr], path: tuple, st: _State) -> bool:
    expr = sym_paths.get(path)
    if expr is not None:
        if isinstance(g, bool) or not isinstance(g, int | float):
            return False
        st.deferred.append((expr, float(g)))
        return True
    if isinstance(p, tuple) and isinstance(g, tuple):
        return len(p) == len(g) and all(
            _same(a, b, sym_paths, (*path, i), st) for i, (a, b) in enumerate(zip(p, g))
        )
    if isinstance(p, np.dtype) or isinstance(g, np.dtype):
        try:
            return _category(p) is _category(g)
        except TypeError:
            return False
    if isinstance(p, float) or isinstance(g, float):
        try:
            return float(p) == float(g)
        except (TypeError, ValueError):
            return False
    return p == g


def _region(program: IR, st: _State, root: Var) -> frozenset[int]:
    """The equations that compute ``root`` from the values bound to the pattern's inputs.

    Walked on the program itself (not the hash-consed nodes), so a duplicate of the matched
    expression elsewhere in the program is not swept into this match."""
    leaves = st.leaves - st.internal
    region: set[int] = set()
    stack: list[Any] = [root]
    seen: set[Any] = set()
    while stack:
        var = stack.pop()
        if not isinstance(var, Var) or var in seen:
            continue
        seen.add(var)
        index = program.producer.get(var)
        if index is None:
            continue
        if var is not root and id(program.view(var).node) in leaves:
            continue  # a bound input (or a layout of one): not part of the match
        region.add(index)
        stack.extend(program.eqns[index].invars)
    return frozenset(region)


def _contained(graph: Graph, region: frozenset[int], root: Var) -> bool:
    """No value computed in ``region`` except ``root`` is used outside it or is an output."""
    eqns = graph.eqns
    for index in region:
        for v in eqns[index].outvars:
            if v is root or not isinstance(v, Var) or type(v).__name__ == "DropVar":
                continue
            try:
                info = graph.info(v)
            except KeyError:
                continue
            if info.is_output or any(c not in region for c in info.consumers):
                return False
    return True


class Rule:
    """A rewrite: wherever ``pattern`` computes a value, compute ``replacement`` instead.

    ``pattern`` (a function, or a sequence of alternative functions) and ``replacement`` are plain
    JAX functions of the same arrays. The dimensions are given as ``shapes`` (``"n d, m d"``: names
    tie dimensions together, integers fix them) or read from ``example_args`` (equal sizes are the
    same dimension, so give independent dimensions different sizes). ``dtype`` is the dtype the
    pattern is traced at (with ``shapes``). Inputs must have the example's dtype category (float,
    integer, ...) unless ``dtypes`` lists the categories allowed, e.g. ``(jnp.floating,)``.
    ``filters`` are predicates on a :class:`Match`. ``batched`` also matches the rule vmapped over
    a leading axis. ``min_bytes_saved``: fire only where XLA's compiled temporaries of the pattern
    exceed the replacement's by at least that many bytes (None: always fire).
    ``check_replacement``: refuse the rule, when it is first traced, if the pattern matches its
    own replacement (it would fire forever); memsafe's built-in rules skip this check at run time
    (it traces every replacement, about a second) because the tests run it on each of them.
    ``needs``: (operation, operand's operation) pairs of canonical operations (``IR`` node ops)
    that every form of the pattern, batched or not, holds (:func:`required_edges`); a program
    without one of them cannot match, and the rule is not traced for it (a pattern's first trace
    is most of what a rule costs a program it does not fire in). Declared, not traced: give
    only pairs each form holds (``tests/test_rules_builtin.py`` checks the built-ins').
    """

    def __init__(
        self,
        name: str,
        pattern: Callable[..., Any] | Sequence[Callable[..., Any]],
        replacement: Callable[..., Any],
        *,
        shapes: str | Sequence[Sequence[sym.AxisSpec]] | None = None,
        example_args: Sequence[Any] | None = None,
        dtype: Any = jnp.float32,
        dtypes: Sequence[Any] | None = None,
        filters: Sequence[Filter] = (),
        batched: bool = True,
        min_bytes_saved: int | None = None,
        description: str = "",
        check_replacement: bool = True,
        needs: Collection[tuple[str, str]] = (),
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("Rule: name must be a non-empty string")
        patterns = list(pattern) if isinstance(pattern, list | tuple) else [pattern]
        if not patterns or not all(callable(p) for p in patterns):
            raise TypeError(f"Rule {name!r}: pattern must be a function or a list of functions")
        if not callable(replacement):
            raise TypeError(f"Rule {name!r}: replacement must be a function")
        if (shapes is None) == (example_args is None):
            raise ValueError(f"Rule {name!r}: give exactly one of shapes= or example_args=")
        if shapes is not None:
            specs = sym.parse_shapes(shapes)
            in_dtypes = [np.dtype(dtype)] * len(specs)
        else:
            arrays = [
                a if isinstance(a, jax.ShapeDtypeStruct) else jnp.asarray(a)
                for a in example_args  # type: ignore[union-attr]
            ]
            specs = sym.symbols_from_sizes([tuple(a.shape) for a in arrays])
            in_dtypes = [np.dtype(a.dtype) for a in arrays]
        self.name = name
        self.patterns = patterns
        self.replacement = replacement
        self.specs = specs
        self.in_dtypes = in_dtypes
        self.dtypes = None if dtypes is None else tuple(dtypes)
        self.filters = tuple(filters)
        self.batched = batched
        self.min_bytes_saved = min_bytes_saved
        self.check_replacement = check_replacement
        self.needs = frozenset((str(a), str(b)) for a, b in needs)
        self.description = description or (replacement.__doc__ or "").strip().split("\n")[0]
        self._variants: list[Variant] | None = None
        self._forms: dict[int, list[Variant]] = {}  # form i, then its batched variants

    def __repr__(self) -> str:
        return f"Rule({self.name!r})"

    @property
    def variants(self) -> list[Variant]:
        """The traced forms of this rule, each followed by its batched variants (traced on
        first use)."""
        if self._variants is None:
            self._variants = [v for i in range(len(self.patterns)) for v in self._form(i, True)]
        return self._variants

    def variants_for(
        self,
        ops: Collection[str],
        ranks: Collection[int] | None = None,
        ends: Collection[tuple[str, int]] | None = None,
        edges: Collection[tuple[str, str]] | None = None,
    ) -> list[Variant]:
        """The variants that can match in a program whose canonical operations (``IR`` node
        ops) are ``ops``, in the order of :attr:`variants`: each form whose operations (those a
        match reaches from the root, :func:`required_ops`) all occur in ``ops``, with its
        batched variants, which hold at least those operations (``jax.vmap`` keeps each
        primitive of these patterns; ``tests/test_rules_builtin.py`` checks it of every built-in
        rule). With ``ranks``, the ranks of the program's values a match can end at, a form's
        batched variants are kept only where ``ranks`` holds one more than its root's rank
        (``jax.vmap`` adds one axis to the pattern's result, and a variant matches only a value
        of its root's rank, :meth:`Variant.match`). Only those variants are traced: a program
        without a rule's operations, or without values of a batched result's rank, does not pay
        for tracing its batched forms. With ``ends``, the (operation, rank) of those values, a
        form's batched variants are kept only where ``ends`` holds its root's operation at one
        more axis (a batched variant's root is its form's root operation, batched: the same
        test checks it): an MLP's gradient has rank-3 values, but none a rule's root makes.
        With ``edges``, the program's (operation, operand's operation) pairs, nothing is traced
        where one of the rule's declared :attr:`needs` is missing, and a form is kept only
        where ``edges`` holds each of its pairs (:func:`required_edges`; a match binds each
        pattern operation to a program operation of the same name, and its operands to that
        operation's operands; a batched variant holds its form's pairs, as it holds its
        operations: the same tests check it)."""
        if edges is not None:
            edges = edges if isinstance(edges, set | frozenset) else set(edges)
            if not self.needs <= edges:
                return []
        ops = ops if isinstance(ops, set | frozenset) else set(ops)
        out = []
        for i in range(len(self.patterns)):
            form = self._form(i, False)
            if not required_ops(form[0]) <= ops:
                continue
            if edges is not None and not required_edges(form[0]) <= edges:
                continue
            root = form[0].root
            batched = self.batched and (ranks is None or root.rank + 1 in ranks)
            batched = batched and (ends is None or (root.node.op, root.rank + 1) in ends)
            out.extend(self._form(i, True) if batched else form)
        return out

    def _form(self, i: int, batched: bool) -> list[Variant]:
        """Form ``i`` traced, and with ``batched`` its batched variants after it (cached)."""
        done = self._forms.get(i)
        if done is None:
            pattern = self.patterns[i]
            done = [Variant(self, f"form {i}", pattern, self.replacement, self.specs,
                            self.in_dtypes)]  # fmt: skip
            self._forms[i] = done
        if batched and self.batched and len(done) == 1:
            done.extend(self._batched(i, self.patterns[i]))
        return done if batched else done[:1]

    def _batched(self, i: int, pattern: Callable[..., Any]) -> list[Variant]:
        n = len(self.specs)
        if n == 0:
            return []
        subsets = (
            [s for k in range(1, n + 1) for s in itertools.combinations(range(n), k)]
            if n <= 3
            else [tuple(range(n))]
        )
        out = []
        for subset in subsets:
            axes = tuple(0 if k in subset else None for k in range(n))
            specs = [((_BATCH, *s) if k in subset else s) for k, s in enumerate(self.specs)]
            out.append(
                Variant(
                    self,
                    f"form {i} batched over inputs {list(subset)}",
                    jax.vmap(pattern, in_axes=axes),
                    jax.vmap(self.replacement, in_axes=axes),
                    specs,
                    self.in_dtypes,
                )
            )
        return out

    def find(self, program: IR, graph: Graph, var: Var) -> Match | None:
        """The first variant of this rule that matches with output ``var``."""
        for variant in self.variants:
            found = variant.match(program, graph, var)
            if found is not None:
                return found
        return None


def _reached(variant: Variant) -> list[Any]:
    """The pattern's nodes reachable from its root through operands, each once."""
    seen: set[int] = set()
    out = []
    stack = [variant.root.node]
    while stack:
        node = stack.pop()
        if node.uid in seen:
            continue
        seen.add(node.uid)
        out.append(node)
        stack.extend(view.node for view in node.operands)
    return out


def required_ops(variant: Variant) -> frozenset[str]:
    """The operations a match of ``variant`` needs in the program: those of the pattern's nodes
    reachable from its root through operands (inputs and literals aside)."""
    return frozenset(n.op for n in _reached(variant) if n.op not in ("input", "literal"))


def required_edges(variant: Variant) -> frozenset[tuple[str, str]]:
    """The (operation, operand's operation) pairs a match of ``variant`` needs in the program:
    those of the pattern's nodes reachable from its root, operands that are inputs or literals
    aside (a pattern input binds any program value)."""
    return frozenset(
        (node.op, view.node.op)
        for node in _reached(variant)
        for view in node.operands
        if view.node.op not in ("input", "literal")
    )


def program_edges(ir: IR) -> set[tuple[str, str]]:
    """The (operation, operand's operation) pairs of a program's canonical form."""
    return {(node.op, view.node.op) for node in ir.nodes for view in node.operands}


__all__ = [
    "Filter",
    "Match",
    "Rule",
    "Variant",
    "program_edges",
    "required_edges",
    "required_ops",
]
