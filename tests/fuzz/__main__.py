"""Run a fuzzing campaign: ``python -m tests.fuzz --budget 1800 --cases 2000``.

Runs cases from consecutive seeds (``--seed``, then seed+1, ...) until ``--cases`` are done or
``--budget`` seconds have passed (no case starts after the budget), prints a table per op family
(programs, split, unchanged, refused, unreachable, outer, timeout, wrong, over, crash) and each
failing program, writes the JSON report, and exits 1 if any case was wrong, over or crashed.

``--seeds 4,23,26`` runs those seeds instead, and ``--seeds-from REPORT.json`` the seeds of an
earlier report whose outcome is one of ``--outcomes`` (by default the failures and timeouts);
given both, the listed seeds come first (each seed runs once; ``--cases`` then caps the list).

Cases run in ``--jobs N`` worker processes (a pool of one for ``--jobs 1``). A case still running
after ``--case-timeout`` seconds (default 300; 0 for no limit) is killed with its pool, recorded
with outcome ``timeout`` (not a failure: a slow compile is not a wrong answer) and the campaign
goes on with a fresh pool (tests/fuzz/schedule.py).

``--deep-fraction 0.4`` makes that share of seeds deep programs (tests/fuzz/deep.py: training
steps of MLPs, layer stacks, transformers, CNNs, graph networks and several large values alive at
once); which seeds are deep depends on the seed and the share only, so a report's seeds rerun
with the same share (``--seeds-from`` takes it from the report unless given).

``--families solver`` makes every seed a deep program of that family (with several, seed ``s``
takes the ``s % len``-th; tests/fuzz/forced.py), for a sample of one family; ``--seeds-from``
takes the families from the report unless given.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from . import forced
from .deep_families import FAMILIES
from .report import format_table, write_json
from .runner import FAILURES, OUTCOMES, Result, run_seed, timeout_result
from .schedule import TimedOut, run_all
from .wrappers import OPTIONS_VARIABLE

#: Default number of cases from ``--seed`` on.
DEFAULT_CASES = 2000


def _results(
    seeds: list[int],
    jobs: int,
    timeout: float,
    deadline: float,
    deep_fraction: float = 0.0,
    families: tuple[str, ...] | None = None,
) -> Iterator[Result]:
    """Results of ``seeds`` in completion order (a share ``deep_fraction`` of them deep, or all
    deep programs of ``families`` when given), ``timeout`` results for cases killed after
    ``timeout`` seconds, starting no case after ``deadline`` (a ``time.monotonic()`` value)."""
    if families:
        run = functools.partial(forced.run_seed, families=families)
    else:
        run = functools.partial(run_seed, deep_fraction=deep_fraction)
    for seed, value in run_all(run, seeds, jobs, timeout, deadline):
        if isinstance(value, TimedOut) and families:
            yield forced.timeout(seed, value.seconds, timeout, families)
        elif isinstance(value, TimedOut):
            yield timeout_result(seed, value.seconds, timeout, deep_fraction)
        else:
            yield value


def _names(text: str, allowed: tuple[str, ...]) -> list[str]:
    """A comma-separated list of names, each one of ``allowed``."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(allowed)}")
    return names


def _seed_list(text: str) -> list[int]:
    """``--seeds``: comma-separated integers."""
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of seeds: {text!r}") from err


def _report_seeds(path: Path, outcomes: list[str]) -> list[int]:
    """The seeds of the results in report ``path`` whose outcome is one of ``outcomes``."""
    data = json.loads(path.read_text())
    return [r["case"]["seed"] for r in data["results"] if r["outcome"] in outcomes]


def _fraction(text: str) -> float:
    """``--deep-fraction``: a share between 0 and 1."""
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"a share between 0 and 1, not {text}")
    return value


def _report_fraction(path: Path) -> float:
    """The share of deep seeds a report's campaign ran with (0 for reports before deep ones)."""
    return float(json.loads(path.read_text())["meta"].get("deep_fraction") or 0.0)


def _report_families(path: Path) -> tuple[str, ...] | None:
    """The families a report's campaign was forced to (None: drawn freely)."""
    families = json.loads(path.read_text())["meta"].get("families")
    return tuple(families) if families else None


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    p = argparse.ArgumentParser(
        prog="python -m tests.fuzz",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cases", type=int, help=f"most cases to run (default {DEFAULT_CASES})")
    p.add_argument("--budget", type=float, default=1800.0, help="seconds to spend at most")
    p.add_argument("--seed", type=int, help="first seed (then seed+1, ...; default 0)")
    p.add_argument("--seeds", type=_seed_list, help="seeds to run, e.g. 4,23,26")
    p.add_argument("--seeds-from", type=Path, metavar="REPORT", help="rerun seeds of a report")
    p.add_argument(
        "--outcomes",
        type=lambda text: _names(text, OUTCOMES),
        default=[*FAILURES, "timeout"],
        help="with --seeds-from: the outcomes to rerun, e.g. refused,timeout "
        "(default: wrong,over,crash,timeout)",
    )
    p.add_argument(
        "--deep-fraction",
        type=_fraction,
        help="share of seeds that draw deep programs (default 0, or the --seeds-from report's)",
    )
    p.add_argument(
        "--families",
        type=lambda text: tuple(_names(text, tuple(sorted(FAMILIES)))),
        help="make every seed a deep program of these families, e.g. solver "
        "(default: as --deep-fraction draws, or the --seeds-from report's)",
    )
    p.add_argument("--jobs", type=int, default=1, help="worker processes")
    p.add_argument(
        "--case-timeout", type=float, default=300.0, help="seconds per case (0: no limit)"
    )
    p.add_argument("--json", type=Path, default=Path("fuzz-report.json"), help="report path")
    p.add_argument("--quiet", action="store_true", help="print only failing or timed-out cases")
    p.add_argument(
        "--ynn-dot",
        action="store_true",
        help="compile memsafe's programs with the YNNPACK type memsafe.tuning times "
        "(jax.jit's reference stays YNNPACK off)",
    )
    return p


def _seeds(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[int]:
    """The seeds the command line asks for, each once, in order."""
    if args.seeds is None and args.seeds_from is None:
        first = args.seed or 0
        return list(range(first, first + (args.cases or DEFAULT_CASES)))
    if args.seed is not None:
        parser.error("--seed does not apply with --seeds or --seeds-from")
    seeds = list(args.seeds or [])
    if args.seeds_from is not None:
        seeds += _report_seeds(args.seeds_from, args.outcomes)
    seeds = list(dict.fromkeys(seeds))
    return seeds[: args.cases] if args.cases is not None else seeds


def _show(result: Result, quiet: bool) -> None:
    """Print one finished case (only failing or timed-out ones when ``quiet``)."""
    if not quiet or result.failed or result.outcome == "timeout":
        print(
            f"seed {result.case.seed}: {result.outcome} ({result.seconds:.1f} s) "
            f"{result.message[:160]}",
            flush=True,
        )


def _finish(
    results: list[Result], seeds: list[int], args: argparse.Namespace, elapsed: float
) -> int:
    """Print the failing programs, the table and the summary line, write the report; returns the
    exit status (1 if any case failed)."""
    results.sort(key=lambda r: r.case.seed)
    failed = [r for r in results if r.failed]
    for r in failed:
        print("\n" + r.describe())
    print()
    print(format_table(results))
    timeouts = [r.case.seed for r in results if r.outcome == "timeout"]
    listed = args.seeds is not None or args.seeds_from is not None
    meta = {
        "cases": len(results),
        "first_seed": seeds[0],
        "seeds": seeds if listed else None,
        "case_timeout": args.case_timeout,
        "deep_fraction": args.deep_fraction,
        "families": list(args.families) if args.families else None,
        "seconds": round(elapsed, 1),
    }
    write_json(args.json, results, meta)
    late = f" (seeds {','.join(map(str, timeouts))})" if timeouts else ""
    print(
        f"\n{len(results)} cases in {elapsed:.0f} s; {len(failed)} failed; "
        f"{len(timeouts)} timed out{late}; report: {args.json}"
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    """Run the campaign the command line describes; returns the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    seeds = _seeds(args, parser)
    if args.deep_fraction is None:
        args.deep_fraction = _report_fraction(args.seeds_from) if args.seeds_from else 0.0
    if args.families is None and args.seeds_from is not None:
        args.families = _report_families(args.seeds_from)
    if not seeds:
        print("no seeds to run", flush=True)
        return 0
    if args.ynn_dot:  # read by the worker processes (tests/fuzz/wrappers.py)
        from memsafe.tuning import CANDIDATE

        os.environ[OPTIONS_VARIABLE] = json.dumps(CANDIDATE)
    start = time.monotonic()
    results: list[Result] = []
    deadline = start + args.budget
    runs = _results(
        seeds, args.jobs, args.case_timeout, deadline, args.deep_fraction, args.families
    )
    for result in runs:
        results.append(result)
        _show(result, args.quiet)
        if len(results) % 100 == 0:
            meta = {"partial": True, "seconds": time.monotonic() - start}
            meta |= {"deep_fraction": args.deep_fraction, "families": args.families}
            write_json(args.json, results, meta)
    if len(results) < len(seeds):
        print(f"budget of {args.budget:g} s spent after {len(results)} cases", flush=True)
    return _finish(results, seeds, args, time.monotonic() - start)


if __name__ == "__main__":
    sys.exit(main())
