"""A one-line progress display on stderr for plans that take more than a couple of seconds.

Off unless asked for: ``memsafe.jit(..., progress=True)`` or the environment variable
``MEMSAFE_PROGRESS=1``. It shows the latest message of memsafe's log (:mod:`memsafe.log`) and the
time spent, redrawn in place, from :data:`DELAY` seconds into a plan; a plan that finishes sooner
prints nothing.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

from memsafe import log

#: Seconds a plan runs before the display appears.
DELAY = 2.0
#: Seconds between redraws.
INTERVAL = 0.25

_open: list[ProgressLine] = []


def enabled(progress: bool | None) -> bool:
    """Whether to show progress: ``progress`` when given, else ``MEMSAFE_PROGRESS=1``."""
    if progress is not None:
        return bool(progress)
    return os.environ.get("MEMSAFE_PROGRESS", "") not in ("", "0")


class ProgressLine:
    """The latest message and the elapsed time, redrawn on one line of ``stream``.

    Args:
        name: the function being planned, shown first.
        stream: where to draw (stderr by default).
        delay: seconds before the first draw (default :data:`DELAY`).
        interval: seconds between redraws (default :data:`INTERVAL`).
    """

    def __init__(
        self,
        name: str,
        stream: TextIO | None = None,
        delay: float | None = None,
        interval: float | None = None,
    ) -> None:
        self.name = name
        self.stream = stream if stream is not None else sys.stderr
        self.delay = DELAY if delay is None else delay
        self.interval = INTERVAL if interval is None else interval
        self.status = "tracing"
        self.shown = False
        self._watch = log.Stopwatch()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="memsafe-progress", daemon=True)

    def update(self, message: str) -> None:
        """Take ``message`` (a log message) as the current status."""
        prefix = f"{self.name}: "
        self.status = message[len(prefix) :] if message.startswith(prefix) else message

    def line(self) -> str:
        """The text drawn now, cut to the terminal's width."""
        width = shutil.get_terminal_size((100, 20)).columns - 1
        text = f"memsafe: {self.name} [{self._watch.elapsed:.1f} s] {self.status}"
        return text if len(text) <= width else text[: max(0, width - 3)] + "..."

    def draw(self) -> None:
        """Redraw the line in place."""
        with self._lock:
            self.stream.write("\r" + self.line() + "\x1b[K")
            self.stream.flush()
            self.shown = True

    def _loop(self) -> None:
        if self._stop.wait(self.delay):
            return
        while not self._stop.is_set():
            self.draw()
            self._stop.wait(self.interval)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop redrawing; a shown line is drawn a last time and ended with a newline."""
        self._stop.set()
        self._thread.join()
        if self.shown:
            self.draw()
            self.stream.write("\n")
            self.stream.flush()


@contextmanager
def display(name: str, show: bool, stream: TextIO | None = None) -> Iterator[None]:
    """Show a :class:`ProgressLine` for ``name`` while the context is open, when ``show`` and no
    display is open already (a plan built inside another one's trace reports on its line)."""
    if not show or _open:
        yield
        return
    line = ProgressLine(name, stream)
    _open.append(line)
    try:
        with log.listening(line.update):
            line.start()
            try:
                yield
            finally:
                line.stop()
    finally:
        _open.remove(line)
