"""How much of each randomized test the default suite runs.

The default suite has a 15-minute budget on CI's 2 cores. Property tests and the fuzzer's seeds run
a share of their examples there; ``make test-full`` (``MEMSAFE_FULL_TESTS=1``) runs them all.
"""

from __future__ import annotations

import os

#: Whether this run is the full one (``make test-full``).
FULL = os.environ.get("MEMSAFE_FULL_TESTS", "") == "1"

#: The share of a property test's examples the default suite runs.
DEFAULT_SHARE = 0.4


def examples(full: int) -> int:
    """The examples a property test runs: ``full`` in the full run, else about
    :data:`DEFAULT_SHARE` of it, and at least 2."""
    return full if FULL else max(2, round(full * DEFAULT_SHARE))
