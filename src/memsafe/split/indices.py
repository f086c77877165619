"""Index arithmetic shared by the gather and scatter rules: positions made chunk-local."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jax import lax

from memsafe._jax import JaxprEqn


def chunk_local_indices(
    eqn: JaxprEqn, indices: Any, comp: int, axis: int, start: Any
) -> tuple[Any, Any]:
    """(global positions, indices made chunk-local) for component ``comp`` of a gather's or
    scatter's index vectors, which addresses operand ``axis``. Clipping modes clip the global
    position first (promise_in_bounds allows any result out of bounds); the caller then binds in
    fill-or-drop mode, so positions other chunks hold fall out of bounds."""
    pos = indices[..., comp]
    if eqn.params["mode"] != lax.GatherScatterMode.FILL_OR_DROP:
        pos = jnp.clip(pos, 0, eqn.invars[0].aval.shape[axis] - 1)
    local = pos - lax.convert_element_type(start, pos.dtype)
    return pos, indices.at[..., comp].set(local)
