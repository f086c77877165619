"""``rewritten(f)``: ``f`` with the algebraic passes (match-and-replace, then reordering) applied,
no memory limit involved."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax

from memsafe import _jax
from memsafe.graph import inline_calls
from memsafe.plan import Plan, RuleRecord
from memsafe.rewrite.chains import reorder_chains
from memsafe.rewrite.match import apply_rules
from memsafe.rules.pattern import Rule
from memsafe.rules.registry import active_rules, builtin_rewrites


@functools.lru_cache(maxsize=64)
def _run(closed: _jax.ClosedJaxpr) -> Callable[..., Any]:
    return jax.jit(lambda *xs: _jax.eval_jaxpr(closed.jaxpr, closed.consts, *xs))


class Rewritten:
    """A function whose program memsafe rewrote; call it like the original (it is traceable)."""

    def __init__(
        self, fun: Callable[..., Any], rules: Sequence[Rule] | None, reorder: bool
    ) -> None:
        self.fun = fun
        self.rules = None if rules is None else list(rules)
        self.reorder = reorder
        self._cache: dict[Any, tuple[_jax.ClosedJaxpr, Any, list[RuleRecord]]] = {}
        functools.update_wrapper(self, fun)

    def _program(self, args: tuple) -> tuple[_jax.ClosedJaxpr, Any, list[RuleRecord]]:
        leaves, tree = jax.tree_util.tree_flatten(args)
        avals = tuple(jax.ShapeDtypeStruct(jax.numpy.shape(x), jax.numpy.result_type(x))
                      for x in leaves)  # fmt: skip
        key = (tree, avals)
        found = self._cache.get(key)
        if found is not None:
            return found

        def flat(*xs: Any) -> Any:
            return self.fun(*jax.tree_util.tree_unflatten(tree, xs))

        closed, out_tree = _jax.make_closed_jaxpr(flat, avals)
        closed = inline_calls(closed)
        rules = active_rules() if self.rules is None else self.rules
        rewrites = builtin_rewrites() if self.rules is None else []
        closed, records = apply_rules(closed, rules, rewrites=rewrites)
        if self.reorder:
            closed, more = reorder_chains(closed)
            records = [*records, *more]
        found = (closed, out_tree, records)
        self._cache[key] = found
        return found

    def __call__(self, *args: Any) -> Any:
        closed, out_tree, _ = self._program(args)
        leaves = jax.tree_util.tree_leaves(args)
        outs = _run(closed)(*leaves)
        return jax.tree_util.tree_unflatten(out_tree, outs)

    def jaxpr(self, *args: Any) -> _jax.ClosedJaxpr:
        """The rewritten program at these arguments' shapes."""
        return self._program(args)[0]

    def plan(self, *args: Any) -> Plan:
        """The rewrites done at these arguments' shapes (rules fired, where, what they saved)."""
        plan = Plan(memory_limit=0)
        plan.records.extend(self._program(args)[2])
        return plan


def rewritten(
    fun: Callable[..., Any], *, rules: Sequence[Rule] | None = None, reorder: bool = True
) -> Rewritten:
    """``fun`` rewritten by match-and-replace (``rules``, default: registered + built-in) and
    matrix-chain reordering. No memory limit is involved: use it to see or keep the rewrites."""
    if not callable(fun):
        raise TypeError(f"rewritten expects a callable, got {type(fun).__name__}")
    return Rewritten(fun, rules, reorder)
