"""Run a fuzzing campaign: ``python -m tests.fuzz --budget 1800 --cases 2000``.

Runs cases from consecutive seeds until ``--cases`` are done or ``--budget`` seconds have passed,
prints a table per op family (programs, split, unchanged, refused, wrong, over, crash) and each
failing program, writes the JSON report, and exits 1 if any case was wrong, over or crashed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from .program import generate
from .report import format_table, write_json
from .runner import run_case


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    parser.add_argument("--cases", type=int, default=2000, help="most cases to run")
    parser.add_argument("--budget", type=float, default=1800.0, help="seconds to spend at most")
    parser.add_argument(
        "--seed", type=int, default=0, help="first seed (cases use seed, seed+1, ...)"
    )
    parser.add_argument("--json", type=Path, default=Path("fuzz-report.json"), help="report path")
    parser.add_argument("--quiet", action="store_true", help="print no line per case")
    args = parser.parse_args(argv)

    start = time.monotonic()
    results = []
    for seed in range(args.seed, args.seed + args.cases):
        if time.monotonic() - start > args.budget:
            print(f"budget of {args.budget:g} s spent after {len(results)} cases", flush=True)
            break
        result = run_case(generate(seed))
        results.append(result)
        if not args.quiet or result.failed:
            print(
                f"seed {seed}: {result.outcome} ({result.seconds:.1f} s) {result.message[:160]}",
                flush=True,
            )
        if len(results) % 100 == 0:
            write_json(args.json, results, {"partial": True, "seconds": time.monotonic() - start})
    elapsed = time.monotonic() - start
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
