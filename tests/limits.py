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


def plan_fitting(fun: Callable[..., Any], args: Sequence[Any], fraction: float = 0.25) -> Any:
    """The plan of ``fun`` under arguments + outputs + ``fraction`` of jax.jit's temporaries
    (:func:`limit_between`), asserted under the limit and giving jax.jit's answers."""
    import memsafe
    from tests.agree import assert_like_jit

    limit = limit_between(fun, args, fraction)
    g = memsafe.jit(fun, memory_limit=limit)
    plan = g.plan(*args)
    assert plan.after.total <= limit, plan
    assert_like_jit(g(*args), fun, *args)
    return plan
