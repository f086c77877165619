"""Facts about primitives live in one table (``memsafe.primitives.TABLE``): every primitive the
split engine has a rule for has a row there, so no pass falls back to the unknown primitive's
facts for one it knows how to split (issue 40)."""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe  # (loads every split rule)
from memsafe import primitives
from memsafe.graph import Graph
from memsafe.primitives import DERIVED, TABLE, Facts, Kind, declare, facts
from memsafe.rewrite import invariants
from memsafe.split.registry import PLAIN, SPLIT_RULES, NoRule, axis_map, rule_of
from memsafe.split.strategies import replay


def test_every_primitive_with_a_split_rule_has_a_table_row():
    missing = sorted(set(SPLIT_RULES) - set(TABLE))
    assert missing == []


def test_layout_ops_that_cut_their_operand_into_pieces_are_layout():
    for name in ("split", "unstack"):
        assert facts(name).kind is Kind.LAYOUT and facts(name).fusible and facts(name).cheap


def test_every_elementwise_primitive_and_reduction_has_a_split_rule():
    kinds = (Kind.ELEMENTWISE, Kind.REDUCTION)
    assert [n for n, row in TABLE.items() if row.kind in kinds and rule_of(n) is None] == []


def test_the_derived_sets_are_those_of_the_table():
    for name, names in DERIVED.items():
        pred = getattr(primitives, name)._pred
        assert set(names) == {n for n, row in TABLE.items() if pred(row)}, name


def test_a_declared_primitive_joins_and_leaves_every_derived_set():
    row = Facts(Kind.ELEMENTWISE, fusible=True, cheap=True, commutative=True, fold=True)
    assert declare("toy_op", row) is None
    try:
        assert facts("toy_op") == row and rule_of("toy_op") is rule_of("add")
        joined = {name for name, names in DERIVED.items() if "toy_op" in names}
        assert joined == {"ELEMENTWISE", "FUSIBLE", "CHEAP", "COMMUTATIVE", "FOLDS", "SHAPE_FREE"}
        # sets other modules build from them follow too
        assert "toy_op" in invariants.UNHELD
        assert declare("toy_op", Facts(Kind.REDUCTION, monoid="sum")) == row
        assert "toy_op" in primitives.REDUCTIONS and "toy_op" not in primitives.ELEMENTWISE
        assert rule_of("toy_op") is rule_of("reduce_sum")
    finally:
        declare("toy_op", None)
    assert "toy_op" not in TABLE and rule_of("toy_op") is None
    assert not any("toy_op" in names for names in DERIVED.values())
    assert "toy_op" not in invariants.UNHELD


def _programs():
    """A small program per primitive the table says is linear in some operands, the
    primitive's operands its arguments (or literals)."""
    a, b = jnp.arange(12.0).reshape(3, 4) - 5.0, jnp.linspace(-2.0, 3.0, 12).reshape(3, 4)
    return {
        "mul": (lambda x, y: x * y, (a, b)),
        "div": (lambda x, y: x / y, (a, b + 10.0)),
        "dot_general": (lambda x, y: lax.dot_general(x, y, (((1,), (1,)), ((), ()))), (a, b)),
        "select_n": (lambda p, x, y: lax.select_n(p, x, y), (a > 0, a, b)),
        "concatenate": (lambda x, y: jnp.concatenate([x, y], 1), (a, b)),
        "pad": (lambda x, v: lax.pad(x, v, [(1, 2, 0), (0, 1, 1)]), (a, jnp.float32(0))),
        "slice": (lambda x: x[1:, ::2], (a,)),
        "rev": (lambda x: lax.rev(x, (1,)), (a,)),
        "reduce_sum": (lambda x: x.sum(0), (a,)),
        "cumsum": (lambda x: lax.cumsum(x, 1), (a,)),
        "dynamic_slice": (lambda x: lax.dynamic_slice(x, (1, 0), (2, 4)), (a,)),
        "dynamic_update_slice": (
            lambda x, u: lax.dynamic_update_slice(x, u, (1, 1)),
            (a, b[:2, :2]),
        ),
    }


def test_every_linear_fact_holds_of_its_primitive():
    """``Facts.linear`` (what ``memsafe.split.linear`` keeps sums through): the primitive's
    result on a sum of two shares of its linear operands is the sum of its results on each,
    its other operands held; in any one of them alone where it is not linear jointly."""
    programs = _programs()
    linear = {n for n, row in TABLE.items() if row.linear is not None}
    assert linear == set(programs)
    rng = np.random.default_rng(0)
    for name, (fun, args) in programs.items():
        closed = jax.make_jaxpr(fun)(*args)
        (eqn,) = [e for e in closed.jaxpr.eqns if e.primitive.name == name]
        vals = dict(zip(closed.jaxpr.invars, args))
        ins = [v.val if hasattr(v, "val") else vals[v] for v in eqn.invars]
        row = facts(name).linear
        where = row.indices(len(ins))
        groups = [where] if row.jointly else [(k,) for k in where]
        for group in groups:
            first, second = list(ins), list(ins)
            for k in group:
                part = rng.standard_normal(np.shape(ins[k])).astype(np.float32)
                first[k], second[k] = part, np.asarray(ins[k]) - part
            whole = eqn.primitive.bind(*ins, **eqn.params)
            summed = eqn.primitive.bind(*first, **eqn.params) + eqn.primitive.bind(
                *second, **eqn.params
            )
            np.testing.assert_allclose(summed, whole, rtol=1e-5, atol=1e-5, err_msg=name)


def test_the_additions_add_their_two_operands():
    """``Facts.adds`` (how memsafe.split.strategies.replay finds the steps of a carry that only
    accumulates): each such primitive, met in a sum and in a gradient's sum of cotangents,
    bound on two arrays gives their sum."""
    x = jnp.arange(6.0).reshape(2, 3)
    sums = jax.make_jaxpr(lambda a, b: a + b)(x, x)
    cotangents = jax.make_jaxpr(jax.grad(lambda a: jnp.sum(jnp.sin(a) * a)))(x)
    found = {
        e.primitive.name: e.primitive
        for closed in (sums, cotangents)
        for e in closed.jaxpr.eqns
        if e.primitive.name in primitives.ADDS
    }
    assert set(found) == set(primitives.ADDS) and found
    a, b = jnp.asarray([1.5, -2.0, np.inf]), jnp.asarray([0.25, 4.0, 1.0])
    for name, prim in found.items():
        np.testing.assert_array_equal(prim.bind(a, b), a + b, err_msg=name)


def _accumulating(c):
    """A loop whose carry ``acc`` only adds each iteration's term; its other carries are sums
    over the whole term, so no axis of ``acc`` passes through the body."""

    def step(carry, _):
        acc, u, v = carry
        t = jnp.tanh(c + u[:, None] - v[None, :])
        return (acc + t, u + jnp.mean(t, 1), v + jnp.mean(t, 0)), None

    init = (jnp.zeros_like(c), jnp.zeros(c.shape[0]), jnp.zeros(c.shape[1]))
    return lax.scan(step, init, None, length=2)[0][0]


def test_the_loops_that_replay_map_an_accumulator_carry_so_only_while_replays_are_tried():
    """``Facts.replays`` (where the planner retries with replays, memsafe.split.strategies.replay):
    the rule of each such loop maps a carry its body only adds to as a replay per chunk of it, in
    the retry's context alone."""
    closed = jax.make_jaxpr(_accumulating)(jnp.ones((6, 5), jnp.float32))
    (loop,) = [e for e in closed.jaxpr.eqns if e.primitive.name in primitives.REPLAYS]
    assert list(primitives.REPLAYS) == [loop.primitive.name]
    assert replay.REPLAYING.applies(Graph(closed))
    assert not replay.REPLAYING.applies(Graph(jax.make_jaxpr(jnp.tanh)(jnp.ones(3))))
    with pytest.raises(NoRule):
        axis_map(loop, ("out", 0), 0, PLAIN)
    replayed = axis_map(loop, ("out", 0), 0, replay.REPLAYING.context(PLAIN))
    assert isinstance(replayed, replay.Replay) and replayed.outs[0] == 0


#: Modules that may hold module-level collections of primitive names, and why: the rest read
#: the table's derived sets (issue 40: facts about primitives in one place).
_NAMES_ALLOWED = {
    "primitives.py": "the table itself",
    "_jax.py": "the module touching JAX internals: the parameters holding sub-programs",
    "split/prims/": "split rules, registered by the names they are rules of",
    "split/sinks.py": "sinks, registered by the names they reduce for",
    "rewrite/generators.py": "rewrite functions by the unary they invert",
    "rules/": "rewrite rules: the operation pairs each rule's pattern needs (``Rule.needs``)",
    "fused/reduce.py": "reducer names (max, and), not primitives",
    "inspect/findings.py": "XLA's HLO opcodes, not jaxpr primitives",
}


def _primitive_names(node, names):
    """The primitive names a collection literal (or ``frozenset(...)`` of one) holds; a dict of
    functions (a registry of rules by primitive) holds none."""
    if isinstance(node, ast.Call) and node.args:
        return _primitive_names(node.args[0], names)
    if isinstance(node, ast.Dict):
        rules = (ast.Name, ast.Lambda, ast.Attribute)
        elts = [] if all(isinstance(v, rules) for v in node.values) else node.keys
    elif isinstance(node, (ast.Tuple, ast.Set, ast.List)):
        elts = node.elts
    else:
        return []
    return [e.value for e in elts if isinstance(e, ast.Constant) and e.value in names]


def test_no_other_module_holds_a_set_of_primitive_names():
    names = set(TABLE) | set(SPLIT_RULES)
    src = pathlib.Path(memsafe.__file__).parent
    found = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src).as_posix()
        if any(rel.startswith(allowed) for allowed in _NAMES_ALLOWED):
            continue
        tree = ast.parse(path.read_text())
        scopes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef))]
        for stmt in (s for scope in scopes for s in scope.body):
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and stmt.value is not None:
                held = [_primitive_names(n, names) for n in ast.walk(stmt.value)]
                if any(len(h) > 1 for h in held):
                    found.append(f"{rel}:{stmt.lineno}")
    assert found == []


def test_the_check_finds_a_set_of_primitive_names():
    tree = ast.parse('LOOPS = ("scan", "while")\nRULES = {"scan": f, "while": g}')
    names = {"scan", "while"}
    assert _primitive_names(tree.body[0].value, names) == ["scan", "while"]
    assert _primitive_names(tree.body[1].value, names) == []
