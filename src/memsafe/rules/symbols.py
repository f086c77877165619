"""Size symbols: which numbers in a traced pattern are dimension sizes, and of which dimensions.

A pattern is traced at two size assignments (distinct primes for each symbol). A parameter or
literal that is the same in both traces is a constant; one that changes is a size expression,
found here as a product of symbols (or its reciprocal, for ``mean``'s ``1/n``).
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: Sizes the two traces give to symbols: distinct primes, unlikely to collide with literals.
PRIMES_A = (11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53)
PRIMES_B = (59, 61, 67, 71, 73, 79, 83, 89, 97, 101, 103, 107)

#: Per-axis spec of one pattern input: a symbol name or a fixed size.
AxisSpec = str | int


@dataclass(frozen=True)
class SizeExpr:
    """``prod(sizes[s] for s in factors) ** (-1 if inverse else 1)``."""

    factors: tuple[str, ...]
    inverse: bool = False

    def evaluate(self, sizes: Mapping[str, int]) -> float:
        value = float(math.prod(sizes[s] for s in self.factors))
        return 1.0 / value if self.inverse else value

    def __str__(self) -> str:
        body = "*".join(self.factors)
        return f"1/({body})" if self.inverse else body


def solve(
    value_a: float, value_b: float, sizes_a: Mapping[str, int], sizes_b: Mapping[str, int]
) -> SizeExpr | None:
    """The size expression that takes ``value_a`` at ``sizes_a`` and ``value_b`` at ``sizes_b``."""
    names = sorted(sizes_a)
    for n in (1, 2, 3):
        for combo in itertools.combinations_with_replacement(names, n):
            pa = math.prod(sizes_a[s] for s in combo)
            pb = math.prod(sizes_b[s] for s in combo)
            for inverse in (False, True):
                ea, eb = (1.0 / pa, 1.0 / pb) if inverse else (float(pa), float(pb))
                if math.isclose(ea, value_a, rel_tol=1e-6) and math.isclose(
                    eb, value_b, rel_tol=1e-6
                ):
                    return SizeExpr(tuple(combo), inverse)
    return None


def parse_shapes(spec: str | Sequence[Sequence[AxisSpec]]) -> list[tuple[AxisSpec, ...]]:
    """``"n d, m d"`` (or ``[("n", "d"), ("m", "d")]``) -> per input, per axis symbol or size.

    ``"n 3"`` fixes an axis at 3; ``""`` between commas is a scalar input.
    """
    if isinstance(spec, str):
        out: list[tuple[AxisSpec, ...]] = []
        for part in spec.split(","):
            axes: list[AxisSpec] = []
            for tok in part.split():
                if re.fullmatch(r"\d+", tok):
                    axes.append(int(tok))
                elif re.fullmatch(r"[A-Za-z_]\w*", tok):
                    axes.append(tok)
                else:
                    raise ValueError(f"shapes: {tok!r} is neither a dimension name nor a size")
            out.append(tuple(axes))
        return out
    result = []
    for shape in spec:
        axes = []
        for a in shape:
            if isinstance(a, bool) or not isinstance(a, str | int):
                raise ValueError(f"shapes: axis {a!r} must be a name or an int")
            axes.append(a)
        result.append(tuple(axes))
    return result


def symbols_from_sizes(shapes: Sequence[Sequence[int]]) -> list[tuple[AxisSpec, ...]]:
    """Symbols for example shapes: equal sizes are one symbol; size 1 stays fixed."""
    names: dict[int, str] = {}
    out = []
    for shape in shapes:
        axes: list[AxisSpec] = []
        for s in shape:
            if s == 1:
                axes.append(1)
            else:
                axes.append(names.setdefault(int(s), f"d{len(names)}"))
        out.append(tuple(axes))
    return out


def assign(specs: Sequence[Sequence[AxisSpec]], primes: Sequence[int]) -> dict[str, int]:
    names: list[str] = []
    for spec in specs:
        for a in spec:
            if isinstance(a, str) and a not in names:
                names.append(a)
    if len(names) > len(primes):
        raise ValueError(f"a pattern may use at most {len(primes)} dimension names")
    return {n: p for n, p in zip(names, primes)}


def concrete(spec: Sequence[AxisSpec], sizes: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(a if isinstance(a, int) else sizes[a] for a in spec)
