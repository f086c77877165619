"""Facts about primitives live in one table (``memsafe.primitives.TABLE``): every primitive the
split engine has a rule for has a row there, so no pass falls back to the unknown primitive's
facts for one it knows how to split (issue 40)."""

from __future__ import annotations

import memsafe  # noqa: F401  (loads every split rule)
from memsafe import primitives
from memsafe.passes import hoist
from memsafe.primitives import DERIVED, TABLE, Facts, Kind, declare, facts
from memsafe.rewrite import invariants
from memsafe.split.registry import SPLIT_RULES, rule_of


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
        assert joined == {"ELEMENTWISE", "FUSIBLE", "CHEAP", "COMMUTATIVE", "FOLDS"}
        # sets other modules build from them follow too
        assert "toy_op" in hoist.POINTWISE and "toy_op" in invariants.UNHELD
        assert declare("toy_op", Facts(Kind.REDUCTION, monoid="sum")) == row
        assert "toy_op" in primitives.REDUCTIONS and "toy_op" not in primitives.ELEMENTWISE
        assert rule_of("toy_op") is rule_of("reduce_sum")
    finally:
        declare("toy_op", None)
    assert "toy_op" not in TABLE and rule_of("toy_op") is None
    assert not any("toy_op" in names for names in DERIVED.values())
    assert "toy_op" not in hoist.POINTWISE and "toy_op" not in invariants.UNHELD
