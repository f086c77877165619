"""memsafe's ``logging.getLogger("memsafe")`` logger, and what the driver reports through it.

The logger has a ``NullHandler`` only, so nothing shows unless the application configures logging
or calls :func:`set_verbosity`. At INFO: each plan's trace, its compile attempts (footprint
against the limit, time) and its outcome; at DEBUG also each pass (records it added, estimated
peak before and after, time). Every message also goes to the listeners a progress display adds
(:mod:`memsafe.progress`), whatever the logger's level.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from memsafe.limits import format_bytes

logger = logging.getLogger("memsafe")
logger.addHandler(logging.NullHandler())

#: Functions called with each message (the progress display), whatever the logger's level.
_listeners: list[Callable[[str], None]] = []

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
_HANDLER_FLAG = "_memsafe_verbosity"


def set_verbosity(level: str | int | None) -> None:
    """Show memsafe's log on stderr at ``level``: ``"debug"`` (each pass), ``"info"`` (traces,
    compile attempts, outcomes), ``"warning"``, a ``logging`` level, or ``None`` to remove the
    handler this function added. Other handlers (your application's) are left alone.

    Args:
        level: the level name, a ``logging`` level number, or None.

    Raises:
        ValueError: an unknown level name.

    Example:
        >>> memsafe.set_verbosity("info")
    """
    for handler in [h for h in logger.handlers if getattr(h, _HANDLER_FLAG, False)]:
        logger.removeHandler(handler)
    if level is None:
        logger.setLevel(logging.NOTSET)
        return
    if isinstance(level, str):
        if level.lower() not in _LEVELS:
            known = ", ".join(_LEVELS)
            raise ValueError(f"memsafe.set_verbosity: unknown level {level!r} ({known})")
        level = _LEVELS[level.lower()]
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
    setattr(handler, _HANDLER_FLAG, True)
    logger.addHandler(handler)
    logger.setLevel(level)


def note(level: int, message: str, *args: Any) -> None:
    """Log ``message % args`` at ``level`` and tell the progress listeners."""
    if _listeners:
        text = message % args if args else message
        for listen in list(_listeners):
            listen(text)
    logger.log(level, message, *args)


@contextmanager
def listening(listen: Callable[[str], None]) -> Iterator[None]:
    """Call ``listen`` with every message noted while the context is open."""
    _listeners.append(listen)
    try:
        yield
    finally:
        _listeners.remove(listen)


class Stopwatch:
    """Seconds since creation (``elapsed``), for the times the log reports."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def traced(name: str, n_eqns: int, seconds: float) -> None:
    """Report that ``name`` was traced to ``n_eqns`` equations."""
    note(logging.INFO, "%s: traced in %.2f s (%d equations)", name, seconds, n_eqns)


def reused(name: str) -> None:
    """Report that ``name``'s program was found verified already (memsafe.cache)."""
    note(logging.INFO, "%s: the same program was verified before: reused", name)


def compiled(
    name: str, what: str, total: int, limit: int, seconds: float, how: str = "compiled"
) -> None:
    """Report one compile-and-verify: ``what`` was compiled (or, per ``how``, loaded), its
    footprint against the limit."""
    verdict = "fits" if total <= limit else f"over by {format_bytes(total - limit)}"
    note(
        logging.INFO,
        "%s: %s %s in %.2f s: footprint %s vs limit %s (%s)",
        name,
        what,
        how,
        seconds,
        format_bytes(total),
        format_bytes(limit),
        verdict,
    )


def pass_done(
    name: str, pass_name: str, added: list[Any], peaks: tuple[int, int] | None, seconds: float
) -> None:
    """Report one pass: the records it added, the estimated peak before and after (when
    computed, at DEBUG only), the time it took."""
    if not (_listeners or logger.isEnabledFor(logging.DEBUG)):
        return
    peak = f"; estimated peak {format_bytes(peaks[0])} -> {format_bytes(peaks[1])}" if peaks else ""
    what = "; ".join(r.describe() for r in added) if added else "no change recorded"
    note(logging.DEBUG, "%s: pass %s (%.2f s)%s: %s", name, pass_name, seconds, peak, what)


def finished(name: str, attempts: int, fits: bool, phases: str) -> None:
    """Report a plan's outcome: its compile attempts, whether it fits, and ``phases``
    (:meth:`memsafe.plan.PlanTime.describe`: how the program was obtained, planned, reused or
    loaded from the plan store, in how long, and the time of each phase)."""
    outcome = "fits the limit" if fits else "does not fit the limit"
    note(logging.INFO, "%s: %s; %d compile attempt(s); %s", name, phases, attempts, outcome)
