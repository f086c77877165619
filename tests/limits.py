"""Limits the tests set between a program's arguments+outputs and jax.jit's footprint."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from memsafe.xla import Footprint, memsafe_jit


def limit_between(fun: Callable[..., Any], args: Sequence[Any], fraction: float) -> int:
    """Arguments + outputs + ``fraction`` of jax.jit's temporaries (YNNPACK off), in bytes."""
    plain = Footprint.from_compiled(memsafe_jit(fun).lower(*args).compile())
    fixed = plain.arguments + plain.outputs
    return fixed + int((plain.total - fixed) * fraction)
