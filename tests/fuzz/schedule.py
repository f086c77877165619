"""Run cases in worker processes, each under a time limit.

A case past its limit cannot be stopped inside a ``multiprocessing.Pool`` worker (an XLA compile
does not return to Python), so :func:`run_all` reports it as :class:`TimedOut`, terminates the
whole pool and starts a fresh one, to which it submits again the cases that were submitted but had
not finished (each reruns from its start: none is lost or reported twice). A case's limit counts
from when its worker reports that it started, so cases waiting in the queue do not use it up.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from multiprocessing.pool import AsyncResult
from typing import Any

#: Seconds between looks for started, finished and late cases.
POLL = 0.05

#: Cases a worker runs before the pool replaces it with a fresh process.
TASKS_PER_WORKER = 50

#: In a worker, the queue its start reports go to (set by ``_init_worker``).
_reports: Any = None


@dataclass(frozen=True)
class TimedOut:
    """A case killed after running ``seconds`` without a result."""

    seconds: float


def _init_worker(reports: Any) -> None:
    """Pool initializer: keep the queue that ``_call`` reports starts to."""
    global _reports
    _reports = reports


def _call(fn: Callable[[int], Any], index: int, seed: int) -> Any:
    """In a worker: report that case ``index`` started, then run ``fn(seed)``. The report is
    written before ``fn`` runs (a ``SimpleQueue`` has no feeder thread that ``fn`` could stall)."""
    _reports.put(index)
    return fn(seed)


class _Workers:
    """A pool of ``jobs`` spawned workers and the cases submitted to it, by index: their seeds and
    pending results (``pending``) and when each was reported started (``started``)."""

    def __init__(self, fn: Callable[[int], Any], jobs: int, timeout: float) -> None:
        self.fn, self.jobs, self.timeout = fn, jobs, timeout
        self.ctx = multiprocessing.get_context("spawn")
        self.pending: dict[int, tuple[int, AsyncResult]] = {}
        self.started: dict[int, float] = {}
        self._open()

    def _open(self) -> None:
        """Start a fresh pool with a fresh start-report queue."""
        self.reports = self.ctx.SimpleQueue()
        self.pool = self.ctx.Pool(
            self.jobs, _init_worker, (self.reports,), maxtasksperchild=TASKS_PER_WORKER
        )

    def close(self) -> None:
        """Stop the workers, finished or not."""
        self.pool.terminate()
        self.pool.join()
        self.reports.close()

    def submit(self, index: int, seed: int) -> None:
        """Queue case ``index``: ``fn(seed)``."""
        job = self.pool.apply_async(_call, (self.fn, index, seed))
        self.pending[index] = (seed, job)

    def poll(self) -> list[tuple[int, Any]]:
        """Wait a moment, then the (seed, result) of each case finished since the last poll and
        (seed, TimedOut) of each past its limit (after which the pool is a fresh one)."""
        time.sleep(POLL)
        self._note_starts()
        done = [i for i, (_, job) in self.pending.items() if job.ready()]
        out = [self._pop(i) for i in done]
        now = time.monotonic()
        late = {i: round(now - t, 1) for i, t in self.started.items() if now - t > self.timeout}
        if late:
            out += [(self._pop(i)[0], TimedOut(seconds)) for i, seconds in late.items()]
            self._restart()
        return out

    def _note_starts(self) -> None:
        """Record the time each case reported since the last look started."""
        while not self.reports.empty():
            index = self.reports.get()
            if index in self.pending:
                self.started[index] = time.monotonic()

    def _pop(self, index: int) -> tuple[int, Any]:
        """Forget case ``index``; its seed and result (``None`` if it has none)."""
        seed, job = self.pending.pop(index)
        self.started.pop(index, None)
        return seed, job.get() if job.ready() else None

    def _restart(self) -> None:
        """Kill every worker and submit the pending cases again to a fresh pool."""
        self.close()
        self._open()
        self.started.clear()
        for index, (seed, _) in sorted(self.pending.items()):
            self.submit(index, seed)


def run_all(
    fn: Callable[[int], Any],
    seeds: Iterable[int],
    jobs: int,
    timeout: float,
    deadline: float = math.inf,
) -> Iterator[tuple[int, Any]]:
    """(seed, ``fn(seed)``) for each of ``seeds``, in completion order, run by ``jobs`` worker
    processes (``fn`` must be picklable); (seed, :class:`TimedOut`) for a case that ran more than
    ``timeout`` seconds (0 or less: no limit). No case is submitted after ``deadline`` (a
    ``time.monotonic()`` value); those submitted before it all finish or time out."""
    todo = deque(enumerate(seeds))
    workers = _Workers(fn, max(jobs, 1), timeout if timeout > 0 else math.inf)
    try:
        while todo or workers.pending:
            if time.monotonic() > deadline:
                todo.clear()
            while todo and len(workers.pending) < 2 * workers.jobs:
                workers.submit(*todo.popleft())
            yield from workers.poll()
    finally:
        workers.close()
