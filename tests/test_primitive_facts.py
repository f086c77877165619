"""Facts about primitives live in one table (``memsafe.primitives.TABLE``): every primitive the
split engine has a rule for has a row there, so no pass falls back to the unknown primitive's
facts for one it knows how to split (issue 40)."""

from __future__ import annotations

import memsafe  # noqa: F401  (loads every split rule)
from memsafe.primitives import TABLE, Kind, facts
from memsafe.split.registry import SPLIT_RULES


def test_every_primitive_with_a_split_rule_has_a_table_row():
    missing = sorted(set(SPLIT_RULES) - set(TABLE))
    assert missing == []


def test_layout_ops_that_cut_their_operand_into_pieces_are_layout():
    for name in ("split", "unstack"):
        assert facts(name).kind is Kind.LAYOUT and facts(name).fusible and facts(name).cheap
