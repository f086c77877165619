"""Run a fuzzing campaign: ``python -m tests.fuzz --budget 1800 --cases 2000``.

Runs cases from consecutive seeds until ``--cases`` are done or ``--budget`` seconds have passed
(no case starts after the budget), prints a table per op family (programs, split, unchanged,
refused, wrong, over, crash) and each failing program, writes the JSON report, and exits 1 if any
case was wrong, over or crashed. ``--jobs N`` runs cases in N processes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from .report import format_table, write_json
from .runner import Result, run_seed


def _results(first: int, cases: int, jobs: int, deadline: float) -> Iterator[Result]:
    """Results of seeds ``first, first + 1, ...`` (in completion order when ``jobs`` > 1),
    starting no case after ``deadline`` (a ``time.monotonic()`` value)."""
    seeds = range(first, first + cases)
    if jobs <= 1:
        for seed in seeds:
            if time.monotonic() > deadline:
                return
            yield run_seed(seed)
        return
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(jobs, maxtasksperchild=50) as pool:
        pending = []
        for seed in seeds:
            if time.monotonic() > deadline:
                break
            pending.append(pool.apply_async(run_seed, (seed,)))
            while len(pending) >= 2 * jobs:
                pending[0].wait()
                while pending and pending[0].ready():
                    yield pending.pop(0).get()
        for job in pending:
            yield job.get()


def main(argv: list[str] | None = None) -> int:
    """Run the campaign the command line describes; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--cases", type=int, default=2000, help="most cases to run")
    parser.add_argument("--budget", type=float, default=1800.0, help="seconds to spend at most")
    parser.add_argument("--seed", type=int, default=0, help="first seed (then seed+1, ...)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--json", type=Path, default=Path("fuzz-report.json"), help="report path")
    parser.add_argument("--quiet", action="store_true", help="print only failing cases")
    args = parser.parse_args(argv)

    start = time.monotonic()
    results: list[Result] = []
    for result in _results(args.seed, args.cases, args.jobs, start + args.budget):
        results.append(result)
        if not args.quiet or result.failed:
            print(
                f"seed {result.case.seed}: {result.outcome} ({result.seconds:.1f} s) "
                f"{result.message[:160]}",
                flush=True,
            )
        if len(results) % 100 == 0:
            write_json(args.json, results, {"partial": True, "seconds": time.monotonic() - start})
    elapsed = time.monotonic() - start
    if len(results) < args.cases:
        print(f"budget of {args.budget:g} s spent after {len(results)} cases", flush=True)
    results.sort(key=lambda r: r.case.seed)
    failed = [r for r in results if r.failed]
    for r in failed:
        print("\n" + r.describe())
    print()
    print(format_table(results))
    meta = {"cases": len(results), "first_seed": args.seed, "seconds": round(elapsed, 1)}
    write_json(args.json, results, meta)
    print(f"\n{len(results)} cases in {elapsed:.0f} s; {len(failed)} failed; report: {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
