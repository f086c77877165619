"""Tally results per op family: a table for the terminal and a JSON report.

Deep cases count toward rows prefixed ``deep:`` (their family, wrapper, dtype and flags). Besides
each outcome, a row counts the cases whose limit lay in the interesting range (``in range``:
strictly between arguments+outputs and jax.jit's footprint) and their outcomes (``range:``
followed by the outcome), so refusal rates there can be read per family.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .runner import FAILURES, OUTCOMES, Result


def tally(results: Iterable[Result]) -> dict[str, Counter]:
    """Per family (and ``"all"``), the number of programs and of each outcome, and among those
    in the interesting range (``in range``) the number of each outcome (``range:OUTCOME``)."""
    table: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        for fam in ["all", *r.families]:
            table[fam]["programs"] += 1
            table[fam][r.outcome] += 1
            if r.interesting:
                table[fam]["in range"] += 1
                table[fam][f"range:{r.outcome}"] += 1
    return dict(table)


def refusal_rate(c: Counter, prefix: str = "") -> str:
    """Refused among programs that have a chunked form (neither unchanged nor unreachable) and
    finished, as a percentage column (``prefix="range:"``: among those in the interesting range;
    their count is ``in range``)."""
    total = c["in range"] if prefix else c["programs"]
    needing = total - sum(c[prefix + k] for k in ("unchanged", "unreachable", "timeout"))
    return f"{100 * c[prefix + 'refused'] / needing:8.1f}%" if needing else "        -"


def blockers_by_family(results: Iterable[Result]) -> dict[str, Counter]:
    """Per family, how many refused programs named each blocking operation."""
    table: dict[str, Counter] = defaultdict(Counter)
    for r in results:
        if r.outcome not in ("refused", "unreachable"):
            continue
        ops = {op for op, _ in r.blockers} or {"(no blocker named)"}
        for fam in ["all", *r.families]:
            table[fam].update(ops)
    return dict(table)


def format_table(results: list[Result]) -> str:
    """A fixed-width table: one row per family, columns programs and each outcome, the refusal
    rate among programs that have a chunked form (neither unchanged nor unreachable) and finished
    (timed-out programs are left out of that rate), the programs in the interesting range and
    the same refusal rate among them."""
    counts = tally(results)
    cols = ("programs", *OUTCOMES)
    width = max([len("family"), *(len(f) for f in counts)])
    head = f"{'family':<{width}} " + " ".join(f"{c:>11}" for c in cols)
    head += f"  refused% {'in range':>11}  refused% in range"
    lines = [head, "-" * len(head)]
    order = ["all", *sorted(f for f in counts if f != "all")]
    for fam in order:
        c = counts.get(fam, Counter())  # "all" is missing when no case ran
        row = f"{fam:<{width}} " + " ".join(f"{c[k]:>11}" for k in cols)
        row += f" {refusal_rate(c)} {c['in range']:>11} {refusal_rate(c, 'range:')}"
        lines.append(row)
    return "\n".join(lines)


def write_json(path: Path, results: list[Result], meta: dict[str, Any]) -> None:
    """Write the campaign: ``meta`` (arguments, timings), the table (every outcome, zeros
    included), blockers per family and every result (failures with their rendered programs)."""
    cols = ("programs", *OUTCOMES, "in range", *(f"range:{k}" for k in OUTCOMES))
    data = {
        "meta": meta,
        "table": {f: {k: c[k] for k in cols} for f, c in tally(results).items()},
        "blockers": {f: dict(c.most_common()) for f, c in blockers_by_family(results).items()},
        "timeouts": [r.case.seed for r in results if r.outcome == "timeout"],
        "failures": [
            {**r.to_json(), "program": r.describe()} for r in results if r.outcome in FAILURES
        ],
        "results": [r.to_json() for r in results],
    }
    path.write_text(json.dumps(data, indent=1, default=str))
