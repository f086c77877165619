"""Parse and format memory sizes: ``"512MiB"``, ``"2GB"``, ``"1.5GiB"``, ``1 << 30``."""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
}
_PATTERN = re.compile(
    r"^\s*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]{1,3})?)\s*([a-zA-Z]*)\s*$"
)

#: The largest limit accepted: XLA counts buffer sizes in signed 64-bit integers.
MAX_LIMIT = 2**63 - 1

_FORMS = (
    "a positive whole number of bytes (1 << 30) or a string of a number and a unit "
    "('512MiB', '2GB', '1.5GiB'; units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, K, M, G)"
)


def _checked(value: int, shown: object) -> int:
    """``value`` if between one byte and :data:`MAX_LIMIT`, else a ValueError naming ``shown``."""
    if value < 1:
        raise ValueError(f"memory_limit must be at least one byte, got {shown!r}")
    if value > MAX_LIMIT:
        raise ValueError(
            f"memory_limit {shown!r} is larger than any memory XLA can count (2**63 - 1 bytes)"
        )
    return value


def _from_number(limit: numbers.Real) -> int:
    """Bytes from an int or a float that is a whole number of bytes."""
    if isinstance(limit, numbers.Integral):
        return _checked(int(limit), limit)
    value = float(limit)
    if math.isnan(value) or math.isinf(value):
        raise ValueError(f"memory_limit must be a finite number of bytes, got {limit!r}")
    if not value.is_integer():
        raise ValueError(
            f"memory_limit {limit!r} is not a whole number of bytes; give an int, or a string "
            f"with a unit such as '{limit}GiB'"
        )
    return _checked(int(value), limit)


def _from_string(limit: str) -> int:
    """Bytes from a size string; a fraction of a byte is an error in bytes, rounded down in
    larger units (``"1.3KiB"`` is 1331 bytes)."""
    match = _PATTERN.match(limit)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in _UNITS:
        raise ValueError(f"cannot read memory_limit {limit!r}: expected {_FORMS}")
    value = Fraction(match.group(1)) * _UNITS[unit]
    if _UNITS[unit] == 1 and value.denominator != 1:
        raise ValueError(f"memory_limit {limit!r} is not a whole number of bytes")
    return _checked(math.floor(value), limit)


def parse_limit(limit: int | float | str) -> int:
    """The number of bytes a memory limit stands for.

    Accepted forms: an ``int`` (``1 << 30``), a ``float`` that is a whole number of bytes
    (``1e9``), or a string of a number and an optional unit, case-insensitive, spaces allowed
    (``"512MiB"``, ``"2 GB"``, ``"1.5GiB"``, ``"1e3 KB"``). Binary units KiB, MiB, GiB, TiB (and
    K, M, G) are powers of 1024; decimal units KB, MB, GB, TB are powers of 1000; B or no unit is
    bytes. A fraction of a byte in a larger unit is rounded down.

    Args:
        limit: the limit as given by the user.

    Returns:
        The limit in bytes, between 1 and 2**63 - 1.

    Raises:
        ValueError: for anything else, naming the value: a bool, zero, a negative number, NaN or
            infinity, a fractional number of bytes (``1.5``), more than 2**63 - 1 bytes (``1e20``),
            an unknown unit or a malformed string (``"1 GB x"``, ``"1.5.2GiB"``).
    """
    if isinstance(limit, bool) or not isinstance(limit, numbers.Real | str):
        raise ValueError(f"memory_limit must be {_FORMS}; got {limit!r} ({type(limit).__name__})")
    if isinstance(limit, str):
        return _from_string(limit)
    return _from_number(limit)


def format_bytes(n: int | float) -> str:
    """Human-readable binary size, e.g. ``152.6 MiB``."""
    n = float(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.0f} {unit}" if unit == "B" else f"{sign}{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
