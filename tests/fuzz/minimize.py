"""Shrink a failing case to a smaller one that fails the same way.

``python -m tests.fuzz.minimize SEED`` runs the case drawn from SEED and, if it fails, tries
simplifications one at a time (drop a chain operation or a sink, no control flow, the plain
wrapper, normal inputs, float32, fewer rows and columns), keeping each that still gives the same
outcome; it prints the smallest program and the ``dataclasses.replace`` call that rebuilds it.
``--deep`` minimizes the deep cases of those seeds (``tests/fuzz/deep.py``: the plain wrapper,
float32, each flag dropped, each size halved, keeping those that still trace); ``--family NAME``
the seeds' cases forced to that family (as ``python -m tests.fuzz --families NAME`` runs them).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from collections.abc import Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from . import deep, ops
from .deep import DeepCase, generate_deep
from .program import GRAD_WRAPPERS, Case, generate, piece_rows
from .runner import Result, run_case


def valid(case: Case | DeepCase) -> bool:
    """Whether every chain operation and sink applies to the shape it receives, and gradient
    wrappers have a float output to differentiate (deep cases: whether it traces)."""
    if isinstance(case, DeepCase):
        return deep.valid(case)
    rows, cols = piece_rows(case.n, case.control, case.splits), case.m
    for name in case.chain:
        op = ops.kind(name)
        if not op.applies(rows, cols):
            return False
        rows, cols = op.shape(rows, cols)
    if not case.sinks or not all(ops.kind(s).applies(rows, cols) for s in case.sinks):
        return False
    return case.wrapper not in GRAD_WRAPPERS or any(ops.kind(s).floats for s in case.sinks)


def _candidates(case: Case | DeepCase) -> Iterator[dict[str, Any]]:
    if isinstance(case, DeepCase):
        yield from deep.candidates(case)
        return
    for i in range(len(case.chain)):
        yield {"chain": case.chain[:i] + case.chain[i + 1 :]}
    for i in range(len(case.sinks)):
        yield {"sinks": case.sinks[:i] + case.sinks[i + 1 :]}
    yield {"control": "none"}
    yield {"wrapper": "plain", "batch": 1}
    yield {"inputs": "normal"}
    yield {"dtype": "float32"}
    yield {"n": max(16, case.n // 2 // 4 * 4)}
    yield {"m": max(64, case.m // 2)}
    yield {"d": 1}


def minimize(
    case: Case | DeepCase, outcome: str | None = None, log: bool = True
) -> tuple[Case | DeepCase, Result]:
    """The smallest case reachable by single simplifications that keeps ``outcome`` (default:
    the outcome of ``case`` itself), with its result."""
    best = run_case(case)
    outcome = outcome or best.outcome
    changed = True
    while changed:
        changed = False
        for change in _candidates(case):
            trial = dataclasses.replace(case, **change)
            if trial == case or not valid(trial):
                continue
            result = run_case(trial)
            if log:
                print(f"  {change}: {result.outcome}", flush=True)
            if result.outcome == outcome:
                case, best, changed = trial, result, True
                if isinstance(case, DeepCase):
                    break  # its candidates spell out whole size tuples: draw them again
    return case, best


def replace_call(case: Case | DeepCase) -> str:
    """``dataclasses.replace(generate(SEED), ...)`` (``generate_deep`` for a deep case) that
    rebuilds ``case``."""
    deep_case = isinstance(case, DeepCase)
    base = generate_deep(case.seed) if deep_case else generate(case.seed)
    diff = {
        f.name: getattr(case, f.name)
        for f in dataclasses.fields(case)
        if getattr(case, f.name) != getattr(base, f.name)
    }
    args = "".join(f", {k}={v!r}" for k, v in diff.items())
    name = "generate_deep" if deep_case else "generate"
    return f"dataclasses.replace({name}({case.seed}){args})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz.minimize", description=__doc__)
    parser.add_argument("seeds", type=int, nargs="+")
    parser.add_argument("--deep", action="store_true", help="the seeds' deep cases")
    parser.add_argument("--family", help="the seeds' deep cases forced to this family")
    args = parser.parse_args(argv)
    for seed in args.seeds:
        if args.family:
            case = generate_deep(seed, family=args.family)
        else:
            case = generate_deep(seed) if args.deep else generate(seed)
        first = run_case(case)
        print(f"seed {seed}: {first.outcome} {first.message[:200]}", flush=True)
        if not first.failed:
            continue
        small, result = minimize(case, first.outcome)
        print("\n" + result.describe())
        print(f"# rebuild: {replace_call(small)}\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
