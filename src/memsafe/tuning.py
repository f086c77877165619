"""Compile options chosen by timing a program's first calls: the CPU's YNNPACK products.

memsafe compiles with every YNNPACK fusion off on the CPU (:mod:`memsafe.xla`): most of them store
buffers ``memory_analysis()`` does not count. One type is trusted,
``LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT``, a matrix product alone, whose output XLA counts in the
program's temporaries (``benchmarks/results/ynn-types.md``), and whose NaN and infinities are
XLA's own product's (``tests/test_tuning.py``). Whether it is faster depends on the program:
measured on 2 cores, a GPT training step ran 10% faster with it and attention's forward 16%,
while a 10k x 1M kNN ran 6-8% slower and attention's backward 5% (``ynn-individual-dot.md``).
So it is timed, not guessed, over the first calls of a program whose work is worth it
(``policy.TUNING.above_flops``), each of which returns its result as usual (:data:`SCHEDULE`):

1. the verified executable, untimed (first touches of its buffers);
2. the same, timed;
3. the candidate, compiled and checked against the limit (else the trial ends), untimed;
4. to 6. the candidate, the verified executable and the candidate again, timed; from then on
   the faster by their fastest calls, the candidate only when faster by ``policy.TUNING.margin``.

A timed call waits for its results. The two executables differ only in how XLA runs each
product: their results agree to the accuracy rule, not bit for bit.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from memsafe import log, policy
from memsafe._jax import ClosedJaxpr, runs_primitive
from memsafe.flops import jaxpr_flops
from memsafe.plan import Plan
from memsafe.xla import Footprint

#: The option value that turns on the one YNNPACK fusion type memsafe trusts.
YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"
CANDIDATE: dict[str, str] = {YNN_OPTION: "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"}

#: Which executable each of a program's first calls runs, and whether the call is timed. The
#: first call of each is not (first touches of its buffers; the candidate is compiled on its
#: first); the timed calls alternate, so that a drift in the machine's speed favours neither.
SCHEDULE: tuple[tuple[str, bool], ...] = (
    ("verified", False),
    ("verified", True),
    ("candidate", False),
    ("candidate", True),
    ("verified", True),
    ("candidate", True),
)

#: A second executable compiled with the given options, and its footprint; None where it does
#: not compile.
Compile = Callable[[dict[str, Any]], "tuple[Any, Footprint] | None"]


def worth_tuning(program: ClosedJaxpr, options: Mapping[str, Any], user: Mapping[str, Any]) -> bool:
    """Whether to time :data:`CANDIDATE` against ``options`` (as compiled): on the CPU, where
    memsafe turned YNNPACK off and the user did not set it, for a program with a matrix product
    and at least ``policy.TUNING.above_flops`` of work."""
    if jax.default_backend() != "cpu" or YNN_OPTION in user or options.get(YNN_OPTION) != "":
        return False
    return (
        runs_primitive(program.jaxpr, {"dot_general"})  # the candidate changes nothing else
        and jaxpr_flops(program.jaxpr.eqns) >= policy.TUNING.above_flops
    )


class Trial:
    """Which executable runs each of a program's first calls, and the one kept after
    (:attr:`chosen`), recorded in the program's ``plan`` (its ``tuning``, and its ``after``
    where the candidate is kept)."""

    def __init__(self, verified: Any, compile_candidate: Compile, plan: Plan, name: str) -> None:
        self._verified, self._compile = verified, compile_candidate
        self._plan, self._name = plan, name
        self._candidate: tuple[Any, Footprint] | None = None
        self._seconds: dict[str, list[float]] = {}
        self._calls = 0
        self._lock = threading.Lock()
        self.chosen: Any = None  # the executable kept, once settled

    @property
    def settled(self) -> bool:
        return self.chosen is not None

    def run(self, flat: Sequence[Any]) -> Any:
        """This call's outputs, from the executable :data:`SCHEDULE` names for it."""
        executable, timed = self._next()
        if timed is None:
            return executable(*flat)
        start = time.perf_counter()
        outs = jax.block_until_ready(executable(*flat))
        self._record(timed, time.perf_counter() - start)
        return outs

    def _next(self) -> tuple[Any, str | None]:
        """The executable for the next call, and what its time measures (None: not timed)."""
        with self._lock:
            self._calls += 1
            if self._calls > len(SCHEDULE) and not self.settled:  # a timed call raised
                self.chosen = self._verified
            if self.settled:
                return self.chosen, None
            role, timed = SCHEDULE[self._calls - 1]
            if role == "candidate" and self._candidate is None:
                self._candidate = self._compiled_candidate()
                if self._candidate is None:
                    return self.chosen, None
            executable = self._verified if role == "verified" else self._candidate[0]
            return executable, role if timed else None

    def _record(self, role: str, seconds: float) -> None:
        with self._lock:
            self._seconds.setdefault(role, []).append(seconds)
            done = sum(len(times) for times in self._seconds.values())
            if done == sum(timed for _, timed in SCHEDULE) and not self.settled:
                self._settle(min(self._seconds["verified"]), min(self._seconds["candidate"]))

    def _compiled_candidate(self) -> tuple[Any, Footprint] | None:
        got = self._compile(dict(CANDIDATE))
        if got is None or got[1].total > self._plan.memory_limit:
            self.chosen = self._verified
            self._plan.tuning = f"{CANDIDATE[YNN_OPTION]} not used: over the limit or no compile"
            return None
        return got

    def _settle(self, verified: float, candidate: float) -> None:
        faster = candidate < (1 - policy.TUNING.margin) * verified
        self.chosen = self._candidate[0] if faster else self._verified
        if faster:
            self._plan.after = self._candidate[1]
        kept = CANDIDATE[YNN_OPTION] if faster else "YNNPACK off"
        self._plan.tuning = (
            f"fastest timed call {verified:.3g} s with YNNPACK off, {candidate:.3g} s with "
            f"{CANDIDATE[YNN_OPTION]}: runs with {kept}"
        )
        log.note(logging.INFO, "%s: %s", self._name, self._plan.tuning)
