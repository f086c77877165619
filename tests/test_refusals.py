"""Every refusal says which of two it is: no chunked program memsafe can build fits the limit
(``missing_rules`` empty), or a chunked program may exist that memsafe has no rule for (the
operations named)."""

from __future__ import annotations

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
