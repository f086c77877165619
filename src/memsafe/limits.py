"""Parse and format memory sizes: ``"512MiB"``, ``"2GB"``, ``"1.5GiB"``, ``1 << 30``."""

from __future__ import annotations

import re

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
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_limit(limit: int | float | str) -> int:
    """Bytes from an int or a string such as ``"512MiB"``; raises ValueError on anything else."""
    if isinstance(limit, bool):
        raise ValueError(f"memory_limit must be bytes or a size string, not {limit!r}")
    if isinstance(limit, int | float):
        if limit != limit or limit <= 0 or limit == float("inf"):
            raise ValueError(f"memory_limit must be a positive number of bytes, got {limit!r}")
        return int(limit)
    if not isinstance(limit, str):
        raise ValueError(
            f"memory_limit must be bytes (int) or a string like '512MiB', "
            f"got {type(limit).__name__}"
        )
    match = _PATTERN.match(limit)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"cannot read memory_limit {limit!r}: expected a number and a unit such as "
            "'512MiB', '2GB', '1.5GiB' (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
        )
    value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if value < 1:
        raise ValueError(f"memory_limit must be at least one byte, got {limit!r}")
    return int(value)


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
