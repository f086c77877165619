"""Reordering: re-parenthesize chains of matrix products by dynamic programming.

A chain is a tree of 2-D ``dot_general`` (matrix-matrix, matrix-vector, with transposes looked
through) whose inner products are used nowhere else; ``reduce_sum`` of a chain is a product with
vectors of ones. The classic matrix-chain programme picks the order with the smallest peak of
live intermediate bytes, then the fewest flops: ``(A @ B) @ v`` becomes ``A @ (B @ v)`` and
``sum(A @ B)`` becomes ``(1^T A)(B 1)``. Another order gives other NaNs and infinities where a
factor is not finite, so the new order runs only where every factor is finite; otherwise the
chain runs as written (a ``lax.cond``; the split pass chunks that branch).

The reorder pass (:mod:`memsafe.passes.reorder`) and ``rewritten``
(:mod:`memsafe.rewrite.algebraic`) run :func:`reorder_chains`.
"""

from __future__ import annotations

import functools
from collections import ChainMap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from memsafe import policy
from memsafe._jax import (
    ClosedJaxpr,
    Literal,
    Var,
    dce,
    eqn_context,
    make_closed_jaxpr,
    nbytes_of_aval,
    source_line,
)
from memsafe.graph import Graph, evaluate, evaluate_eqns
from memsafe.plan import RuleRecord


@dataclass(frozen=True)
class Factor:
    """One matrix of a chain, as 2-D ``rows x cols``: a program value (maybe transposed or a
    vector stood up as a row or column) or a vector of ones."""

    atom: Any  # Var or Literal; None for ones
    rows: int
    cols: int
    transposed: bool = False
    dtype: Any = None

    def value(self, read: Callable[[Any], Any]) -> Any:
        if self.atom is None:
            return jnp.ones((self.rows, self.cols), self.dtype)
        x = read(self.atom) if isinstance(self.atom, Var) else jnp.asarray(self.atom.val)
        if x.ndim == 1:
            return jnp.reshape(x, (self.rows, self.cols))
        return x.T if self.transposed else x

    def flipped(self) -> Factor:
        return Factor(self.atom, self.cols, self.rows, not self.transposed, self.dtype)

    def name(self) -> str:
        if self.atom is None:
            return f"ones[{self.rows}x{self.cols}]"
        base = f"{self.rows}x{self.cols}"
        return f"{base}.T" if self.transposed and min(self.rows, self.cols) > 1 else base


@dataclass(frozen=True)
class Cost:
    """Peak live intermediate bytes, flops, and the bytes of the result if it is intermediate."""

    peak: int
    flops: int
    size: int


def _combine(left: Cost, right: Cost, out_bytes: int, flops: int) -> Cost:
    first = min(max(left.peak, left.size + right.peak), max(right.peak, right.size + left.peak))
    peak = max(first, left.size + right.size + out_bytes)
    return Cost(peak, left.flops + right.flops + flops, out_bytes)


@dataclass
class Chain:
    factors: list[Factor]
    cost: Cost  # of the program's own order
    region: set[int]  # equations of the chain (inner dots, transposes, the root)
    root: Var
    root_index: int
    itemsize: int


def _is_matmul(eqn: Any) -> bool:
    if eqn.primitive.name != "dot_general":
        return False
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if lb or rb or len(lc) != 1 or len(rc) != 1:
        return False
    lhs, rhs = eqn.invars
    return lhs.aval.ndim in (1, 2) and rhs.aval.ndim in (1, 2)


class _Extractor:
    """Finds chains in one program."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.eqns = graph.eqns

    def _single_use(self, var: Any) -> int | None:
        """The producing equation of ``var`` if its only use is one consumer (not an output)."""
        if not isinstance(var, Var):
            return None
        info = self.graph.info(var)
        if info.producer is None or info.is_output or len(set(info.consumers)) != 1:
            return None
        if info.consumers.count(info.consumers[0]) != 1:
            return None
        return info.producer

    def operand(
        self, atom: Any, side: str, contract: int, region: set[int]
    ) -> tuple[list[Factor], Cost]:
        """Factors whose product is ``atom`` as the ``side`` operand of a matmul, 2-D."""
        current = atom
        seen: set[int] = set()
        while True:  # look through transposes used only here: the contraction axis moves
            index = self._single_use(current)
            if index is None:
                break
            eqn = self.eqns[index]
            if eqn.primitive.name != "transpose" or current.aval.ndim != 2:
                break
            seen.add(index)
            current = eqn.invars[0]
            contract = 1 - contract
        region |= seen
        index = self._single_use(current)
        if index is not None and _is_matmul(self.eqns[index]):
            region.add(index)
            factors, cost = self.natural(index, region)
            rows, cols = factors[0].rows, factors[-1].cols
            if current.aval.ndim == 2:  # lhs wants (free, contract), rhs (contract, free)
                need = (contract == 0) if side == "lhs" else (contract == 1)
            else:  # a vector: lhs wants a row (1, k), rhs a column (k, 1)
                need = (rows != 1) if side == "lhs" else (cols != 1)
            if need:
                factors = [f.flipped() for f in reversed(factors)]
            return factors, cost
        aval = current.aval
        dtype = aval.dtype
        if aval.ndim == 1:
            (k,) = aval.shape
            shape = (1, k) if side == "lhs" else (k, 1)
            return [Factor(current, *shape, False, dtype)], Cost(0, 0, 0)
        r, c = aval.shape
        transposed = (contract == 0) if side == "lhs" else (contract == 1)
        rows, cols = (c, r) if transposed else (r, c)
        return [Factor(current, rows, cols, transposed, dtype)], Cost(0, 0, 0)

    def natural(
        self, index: int, region: set[int], root: bool = False
    ) -> tuple[list[Factor], Cost]:
        """Factors of a matmul's result as (lhs free or 1) x (rhs free or 1); the cost counts
        the result as an intermediate unless it is the chain's ``root``."""
        eqn = self.eqns[index]
        (lc, rc), _ = eqn.params["dimension_numbers"]
        lhs, rhs = eqn.invars
        lf, lcost = self.operand(lhs, "lhs", int(lc[0]), region)
        rf, rcost = self.operand(rhs, "rhs", int(rc[0]), region)
        n, k, m = lf[0].rows, lf[-1].cols, rf[-1].cols
        out = eqn.outvars[0]
        itemsize = np.dtype(out.aval.dtype).itemsize
        cost = _combine(lcost, rcost, 0 if root else n * m * itemsize, 2 * n * k * m)
        return lf + rf, cost

    def chain_at(self, index: int) -> Chain | None:
        eqn = self.eqns[index]
        region: set[int] = {index}
        if _is_matmul(eqn):
            factors, cost = self.natural(index, region, root=True)
        elif eqn.primitive.name == "reduce_sum":
            inner = self._single_use(eqn.invars[0])
            if inner is None or not _is_matmul(self.eqns[inner]):
                return None
            factors, cost = self.natural(inner, region)
            region.add(inner)
            rows, cols = factors[0].rows, factors[-1].cols
            dtype = eqn.outvars[0].aval.dtype
            axes = {int(a) for a in eqn.params["axes"]}
            kept = [s for s in (rows, cols) if s != 1]  # the dot's output axes
            summed = {kept_axis for kept_axis in range(len(kept)) if kept_axis in axes}
            # map output axes back to the 2-D form: axis 0 is rows unless rows == 1
            two_d = [0, 1] if rows != 1 and cols != 1 else ([0] if rows != 1 else [1])
            sum_rows = any(two_d[a] == 0 for a in summed)
            sum_cols = any(two_d[a] == 1 for a in summed)
            if sum_rows:
                factors = [Factor(None, 1, rows, False, dtype), *factors]
            if sum_cols:
                factors = [*factors, Factor(None, cols, 1, False, dtype)]
            itemsize = np.dtype(dtype).itemsize
            out_rows = 1 if sum_rows else rows
            out_cols = 1 if sum_cols else cols
            cost = Cost(cost.peak, cost.flops + rows * cols, out_rows * out_cols * itemsize)
        else:
            return None
        if len(factors) < 3:
            return None
        dtypes = {np.dtype(f.dtype) for f in factors}
        if len(dtypes) != 1:
            return None
        out = eqn.outvars[0]
        itemsize = np.dtype(out.aval.dtype).itemsize
        root_cost = Cost(cost.peak, cost.flops, 0)
        return Chain(factors, root_cost, region, out, index, itemsize)


Tree = int | tuple[Any, Any]


def best_order(dims: list[int], itemsize: int) -> tuple[Tree, Cost]:
    """Matrix-chain order for factors of shapes dims[i] x dims[i+1]: least peak, then flops."""
    n = len(dims) - 1

    @functools.cache
    def solve(i: int, j: int) -> tuple[tuple[int, int], Tree, Cost]:
        if i == j:
            return (0, 0), i, Cost(0, 0, 0)
        root = i == 0 and j == n - 1
        out_bytes = 0 if root else dims[i] * dims[j + 1] * itemsize
        best = None
        for k in range(i, j):
            _, lt, lc = solve(i, k)
            _, rt, rc = solve(k + 1, j)
            cost = _combine(lc, rc, out_bytes, 2 * dims[i] * dims[k + 1] * dims[j + 1])
            key = (cost.peak, cost.flops)
            if best is None or key < best[0]:
                best = (key, (lt, rt), cost)
        assert best is not None
        return best

    _, tree, cost = solve(0, n - 1)
    return tree, cost


def _describe(tree: Tree, factors: list[Factor]) -> str:
    if isinstance(tree, int):
        return factors[tree].name()
    return f"({_describe(tree[0], factors)} @ {_describe(tree[1], factors)})"


def _emit(tree: Tree, values: list[Any]) -> Any:
    if isinstance(tree, int):
        return values[tree]
    return jnp.matmul(_emit(tree[0], values), _emit(tree[1], values))


def _all_finite(x: Any) -> Any:
    """Whether every element of ``x`` is finite, from its max and min (XLA's max and min carry
    a NaN through): no elementwise intermediate of ``x``'s size for the split pass to see."""
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.bool_(True)
    axes = tuple(range(x.ndim))
    return jnp.isfinite(lax.reduce_max(x, axes)) & jnp.isfinite(lax.reduce_min(x, axes))


def _as_written(eqns: Any, chain: Chain, env: dict[Any, Any]) -> Any:
    """The chain's own equations, in the program's order, from the values they read outside it:
    where a factor is not finite, another order gives other NaNs and infinities (an inf row of
    ``x`` in ``(x @ y.T) @ v`` is NaN where the products' signs mix, inf in ``x @ (y.T @ v)``)."""
    local: dict[Any, Any] = {}
    evaluate_eqns(eqns, sorted(chain.region), ChainMap(local, env))
    return local[chain.root]


def _pays(written: Cost, best: Cost, root_bytes: int) -> bool:
    """Whether the ``best`` order lowers the ``written`` order's peak, the chain's result of
    ``root_bytes`` counted in, enough to run instead."""
    return written.peak - best.peak >= policy.REWRITE.min_peak_gain * (written.peak + root_bytes)


def find_chains(closed: ClosedJaxpr) -> list[tuple[Chain, Tree, Cost]]:
    """Chains whose best order beats the program's, outermost first, not overlapping."""
    graph = Graph(closed)
    extractor = _Extractor(graph)
    claimed: set[int] = set()
    found = []
    for index in reversed(range(len(graph.eqns))):
        if index in claimed:
            continue
        chain = extractor.chain_at(index)
        if chain is None or chain.region & claimed:
            continue
        dims = [chain.factors[0].rows] + [f.cols for f in chain.factors]
        tree, cost = best_order(dims, chain.itemsize)
        if not _pays(chain.cost, cost, nbytes_of_aval(chain.root.aval)):
            continue
        claimed |= chain.region
        found.append((chain, tree, cost))
    return found


def reorder_chains(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[RuleRecord]]:
    """``closed`` with its matrix chains re-parenthesized, and a record per chain."""
    found = find_chains(closed)
    if not found:
        return closed, []
    at = {chain.root_index: (chain, tree) for chain, tree, _ in found}
    env: dict[Any, Any] = {}

    def override(index: int, eqn: Any, invals: list[Any]) -> list[Any] | None:
        hit = at.get(index)
        if hit is None:
            return None
        chain, tree = hit
        eqns = closed.jaxpr.eqns
        with eqn_context(eqn):
            values = [f.value(env.__getitem__) for f in chain.factors]

            def reordered() -> Any:
                out = _emit(tree, values)
                return jnp.reshape(out, chain.root.aval.shape).astype(chain.root.aval.dtype)

            def as_written() -> Any:
                return _as_written(eqns, chain, env)

            finite = functools.reduce(jnp.logical_and, map(_all_finite, values))
            return [lax.cond(finite, reordered, as_written)]

    def program(*xs: Any) -> list[Any]:
        env.clear()
        return evaluate(closed, xs, override, env)

    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
    new, _ = make_closed_jaxpr(program, avals)
    records = []
    eqns = closed.jaxpr.eqns
    for chain, tree, cost in found:
        records.append(
            RuleRecord(
                rule="reorder_chain",
                where=source_line(eqns[chain.root_index]),
                bytes_saved=chain.cost.peak - cost.peak,
                flops_saved=chain.cost.flops - cost.flops,
                detail=f"{len(chain.factors)}-factor chain as {_describe(tree, chain.factors)}",
            )
        )
    return dce(new), records


__all__ = ["Chain", "Factor", "Literal", "best_order", "find_chains", "reorder_chains"]
