"""The default suite's slow list from a timed run: ``tests/slow.txt``.

Run the default suite with ``pytest -n 2 -q --durations=0 > durations.log``, then
``python -m tools.slow_tests durations.log`` writes every test whose setup, call and teardown
together took at least ``--seconds`` into ``tests/slow.txt`` (kept beside the ones listed there
already). ``tests/conftest.py`` marks the listed tests ``slow``: ``make test`` leaves them out,
``make test-slow`` and ``make test-full`` run them.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

LIST = Path(__file__).resolve().parents[1] / "tests" / "slow.txt"
_LINE = re.compile(r"\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+)")
_HEADER = """\
# Tests `make test` leaves out (marked slow by tests/conftest.py): written by tools/slow_tests.py
# from a timed run of the default suite (pytest -n 2 --durations=0) on 2 cores; each took at
# least the threshold there. `make test-slow` runs them.
"""


def durations(log: Path) -> Counter[str]:
    """Seconds per test node id (setup, call and teardown summed) in a ``--durations=0`` log."""
    seconds: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        m = _LINE.match(line)
        if m:
            seconds[m.group(2)] += float(m.group(1))
    return seconds


def listed(path: Path = LIST) -> set[str]:
    """The node ids ``path`` lists (comments and blank lines skipped)."""
    if not path.exists():
        return set()
    lines = (line.strip() for line in path.read_text().splitlines())
    return {line for line in lines if line and not line.startswith("#")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=Path, help="output of pytest --durations=0")
    parser.add_argument("--seconds", type=float, default=12.0, help="threshold (default 12)")
    args = parser.parse_args(argv)
    seconds = durations(args.log)
    slow = {t for t, s in seconds.items() if s >= args.seconds}
    kept = listed()
    LIST.write_text(_HEADER + "".join(f"{t}\n" for t in sorted(slow | kept)))
    rest = sum(s for t, s in seconds.items() if t not in slow | kept)
    print(f"{len(slow | kept)} tests listed ({len(slow - kept)} new); the rest took {rest:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
