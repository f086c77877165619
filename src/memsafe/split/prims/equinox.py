"""Equinox's primitives (the loops of diffrax, optimistix and lineax are written with them).

- ``vprim`` is a primitive of equinox's under ``jax.vmap``: the operands carry the mapped axis at
  ``__batch_axes`` (None: shared), each result at 0, and it is evaluated as ``jax.vmap`` of the
  inner primitive: position by position along that axis by construction. The split axis passes
  where it is the mapped one; a chunk is the same primitive over ``n`` positions.
- ``select_if_vmap`` selects between two values by a scalar predicate (a batched predicate
  becomes ``lax.select`` under ``vmap``): elementwise in the values.
"""

from __future__ import annotations

from typing import Any

from memsafe._jax import JaxprEqn, bind_eqn_with
from memsafe.split.registry import (
    Mapping,
    NoRule,
    RuleContext,
    Side,
    elementwise,
    split_rule,
)

_AXES, _SIZE = "__batch_axes", "__axis_size"


def _mapped(eqn: JaxprEqn) -> tuple[Any, ...]:
    axes = eqn.params.get(_AXES)
    if not isinstance(axes, tuple) or len(axes) != len(eqn.invars):
        raise NoRule("vprim: its operands' mapped axes are not one per operand")
    if not all(a is None or isinstance(a, int) for a in axes):
        raise NoRule("vprim: its operands' mapped axes are not plain axes")
    return axes


@split_rule("vprim", rebind=lambda *a: _rebind_vprim(*a), positional=True)
def _vprim(eqn: JaxprEqn, side: Side, axis: int, ctx: RuleContext) -> Mapping:
    """Along the axis the primitive maps: every mapped operand at its axis, every result at 0."""
    axes = _mapped(eqn)
    given = axes[side[1]] if side[0] == "in" else 0
    if given != axis:
        raise NoRule(f"vprim: the split axis is not the axis {eqn.params.get('prim')} maps over")
    return Mapping(ins=tuple(axes), outs=(0,) * len(eqn.outvars))


def _rebind_vprim(eqn: JaxprEqn, invals: list[Any], m: Mapping, start: Any, n: int) -> list[Any]:
    """The primitive mapped over the chunk's ``n`` positions."""
    return bind_eqn_with(eqn, invals, **{_SIZE: n})


elementwise("select_if_vmap")
