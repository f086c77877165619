"""The accuracy rule for tests (docs/accuracy.md, tests/fuzz/accuracy.py): memsafe's result against
jax.jit's, with NaN, infinities and integers exact and floats within a small multiple of jax.jit's
own error against the float64 program. A fixed tolerance such as ``rtol=1e-5`` is not the rule: a
float32 sum that cancels can differ by more between two XLA builds of jax.jit itself."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memsafe.xla import memsafe_jit
from tests.fuzz.accuracy import check


def _wide(a: Any) -> Any:
    return np.asarray(a, np.float64) if jnp.issubdtype(jnp.result_type(a), jnp.floating) else a


def assert_like_jit(got: Any, f: Callable[..., Any], *args: Any) -> None:
    """``got`` obeys the accuracy rule against jax.jit's ``f(*args)`` (YNNPACK off, as memsafe
    compiles), measured against ``f`` in float64."""
    with jax.enable_x64():
        ref = memsafe_jit(f)(*jax.tree.map(_wide, args))
    assert check(got, memsafe_jit(f)(*args), ref) == []
