"""Every refusal says which of two it is: no chunked program memsafe can build fits the limit
(``missing_rules`` empty), or a chunked program may exist that memsafe has no rule for (the
operations named)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import memsafe

N, M = 256, 4096


def _args():
    rng = np.random.default_rng(0)
    return jnp.asarray(rng.standard_normal(N, dtype=np.float32)), jnp.asarray(
        rng.standard_normal(M, dtype=np.float32)
    )


def _refusal(fun, limit=256 * 1024) -> memsafe.MemoryLimitError:
    with pytest.raises(memsafe.MemoryLimitError) as info:
        memsafe.jit(fun, memory_limit=limit)(*_args())
    return info.value


def test_sorts_along_every_axis_leave_no_chunked_program():
    def fun(x, y):
        s = x[:, None] * y[None, :]
        return jnp.sort(s, axis=1)[:, :3], jnp.sort(s, axis=0)[:3]

    err = _refusal(fun)
    assert err.missing_rules == []
    assert "no chunked program memsafe can build fits this limit" in str(err)
    assert all(b.inherent for b in err.blockers)


def test_an_operation_without_a_rule_is_named():
    def fun(x, y):
        s = x[:, None] * y[None, :]
        return lax.approx_max_k(s, 2)[0]  # rows could be chunked; approx_top_k has no rule

    err = _refusal(fun)
    assert "approx_top_k" in err.missing_rules
    assert "a chunked program may exist: memsafe has no rule to split through" in str(err)


def test_arguments_over_the_limit_leave_no_chunked_program():
    err = _refusal(lambda x, y: x[:, None] * y[None, :], limit=1024)
    assert err.missing_rules == []
    assert "arguments and outputs alone" in str(err)
    assert "no chunked program memsafe can build fits this limit" in str(err)


def test_values_too_small_to_close_the_gap_are_left_out_and_name_no_missing_rule():
    """The last attempts shrink the budget until the planner tries values of a few bytes inside
    loop bodies (deep fuzz seed 347: 4-byte ``select_n`` operands): those cannot close a gap of
    hundreds of kilobytes, so the refusal counts them instead of naming their operations as
    missing rules."""
    from memsafe.errors import Blocker
    from memsafe.search import refusal
    from memsafe.xla import Footprint

    def blocker(n: int, operation: str, inherent: bool) -> Blocker:
        reason = "why"
        return Blocker(f"float32[{n}]", (n,), "float32", 4 * n, operation, reason, "", inherent)

    big, tiny = blocker(1 << 18, "split", True), blocker(1, "select_n", False)
    limit = 1 << 20
    best = Footprint(arguments=limit + (640 << 10), outputs=0, temps=0, aliases=0)
    flat = jax.make_jaxpr(lambda x: x * 2.0)(jnp.ones(4))
    err = refusal(flat, "f", limit, None, best, [big, tiny])
    assert err.blockers == [big] and err.missing_rules == []
    assert "1 smaller values that could not be split are left out: each under 10.0 KiB" in str(err)
    assert "no chunked program memsafe can build fits this limit" in str(err)
    # with nothing compiled (no gap known) every blocker is reported
    assert refusal(flat, "f", limit, None, None, [big, tiny]).missing_rules == ["select_n"]
