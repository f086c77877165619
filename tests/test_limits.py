"""``memory_limit`` forms: what is accepted, and the message each bad value gets."""

from __future__ import annotations

import numpy as np
import pytest

import memsafe
from memsafe.limits import MAX_LIMIT, parse_limit


@pytest.mark.parametrize(
    ("limit", "expected"),
    [
        (1e9, 10**9),
        (np.int64(4096), 4096),
        ("1e3 KB", 10**6),
        ("1.3KiB", 1331),
        (".5k", 512),
        (MAX_LIMIT, MAX_LIMIT),
    ],
)
def test_accepted_forms(limit, expected):
    assert parse_limit(limit) == expected


@pytest.mark.parametrize(
    ("limit", "message"),
    [
        (
            1.5,
            "memory_limit 1.5 is not a whole number of bytes; give an int, or a string with a "
            "unit such as '1.5GiB'",
        ),
        ("1.5", "memory_limit '1.5' is not a whole number of bytes"),
        (1e20, "memory_limit 1e+20 is larger than any memory XLA can count"),
        (2**63, "memory_limit 9223372036854775808 is larger than any memory XLA can count"),
        ("1e999GiB", "memory_limit '1e999GiB' is larger than any memory XLA can count"),
        (-1, "memory_limit must be at least one byte, got -1"),
        (0, "memory_limit must be at least one byte, got 0"),
        (0.0, "memory_limit must be at least one byte, got 0.0"),
        (float("nan"), "memory_limit must be a finite number of bytes, got nan"),
        (float("inf"), "memory_limit must be a finite number of bytes, got inf"),
        (True, "got True (bool)"),
        (None, "got None (NoneType)"),
        ("1 GB x", "cannot read memory_limit '1 GB x': expected a positive whole number"),
        ("1.5.2GiB", "cannot read memory_limit '1.5.2GiB'"),
        ("12 parsecs", "cannot read memory_limit '12 parsecs'"),
        ("1e99999999GiB", "cannot read memory_limit '1e99999999GiB'"),
    ],
)
def test_bad_limits_name_the_value(limit, message):
    with pytest.raises(ValueError) as info:
        parse_limit(limit)
    assert message in str(info.value)


def test_memsafe_jit_rejects_a_fractional_limit_at_once():
    with pytest.raises(ValueError, match=r"memory_limit 1\.5 is not a whole number of bytes"):
        memsafe.jit(lambda x: x, memory_limit=1.5)
