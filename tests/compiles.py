"""XLA compile requests counted through JAX's monitoring (one listener for the test session)."""

from __future__ import annotations

import jax


class Compiles:
    """How many backend compiles JAX has reported so far (``Compiles.count``)."""

    count = 0

    @classmethod
    def on_event(cls, event: str, _duration: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            cls.count += 1


jax.monitoring.register_event_duration_secs_listener(Compiles.on_event)
