"""A way regions grow that the split pass turns on for some of its tries (loops replayed per
chunk, :mod:`memsafe.split.replay`; extended chunks, :mod:`memsafe.split.halo`): split rules ask
whether it is on. A context variable, so that each thread and compile job sees its own."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator


class Mode:
    """A switch that is on within :meth:`on`'s context."""

    def __init__(self, name: str) -> None:
        self._on: contextvars.ContextVar[bool] = contextvars.ContextVar(name, default=False)

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        """Within this context, the mode is on."""
        token = self._on.set(True)
        try:
            yield
        finally:
            self._on.reset(token)

    def enabled(self) -> bool:
        """Whether the mode is on here."""
        return self._on.get()
