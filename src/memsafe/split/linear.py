"""Which equations keep a sum over the split axis a sum.

Inside a loop body split along an axis (the batch through a backward scan over layers), a
reduction over that axis gives each chunk its *share* of a sum: each layer's parameter
gradient, summed over the batch. A value computed from shares stays a share, and the shares of
the chunks add up to the whole program's value, only through operations linear in them with
every other operand the same on every chunk: products with a value read whole, sums of shares,
transposes, reductions over other axes, contractions with a value read whole. An ``x + c`` with
``c`` read whole is not (each chunk would add ``c`` once more), nor a product of two shares.

:func:`keeps_sums` answers for one equation given what each operand is (:class:`Role`).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import numpy as np

from memsafe._jax import JaxprEqn
from memsafe.primitives import Linear, Scaling, facts


class Role(enum.Enum):
    """What one operand of an equation is, as the split of a loop body sees it."""

    WHOLE = "whole"  # the same on every chunk (read whole, or computed from such values)
    ZERO = "zero"  # a literal zero, or a broadcast of one: adds nothing to a sum
    SHARE = "share"  # the chunk's share of a sum over the split axis
    SPLIT = "split"  # carries the split axis


def keeps_sums(eqn: JaxprEqn, roles: Sequence[Role]) -> bool:
    """Whether ``eqn``'s results are shares of sums, given its operands' ``roles`` (at least
    one a share, none split)."""
    if Role.SPLIT in roles:
        return False
    row = facts(eqn.primitive.name)
    if row.linear is not None:
        return _linear_in(roles, row.linear)
    scaling = row.scaling
    if scaling is Scaling.SAME:
        return _linear_in(roles, Linear(slice(None)))  # sums and differences
    if scaling is Scaling.COMMUTES and not _inexact(eqn):
        return False  # a share converted to an integer no longer adds up
    return len(roles) == 1 and scaling is not None


def _linear_in(roles: Sequence[Role], linear: Linear) -> bool:
    """Whether operands of ``roles`` keep a sum through an operation ``linear`` in some of
    them (the table's :class:`memsafe.primitives.Linear`)."""
    inside = linear.indices(len(roles))
    if not linear.jointly:
        shares = [k for k, r in enumerate(roles) if r is Role.SHARE]
        return len(shares) == 1 and shares[0] in inside
    return all(
        r is Role.ZERO
        if k in linear.zero
        else (r in (Role.SHARE, Role.ZERO))
        if k in inside
        else r is Role.WHOLE
        for k, r in enumerate(roles)
    )


def _inexact(eqn: JaxprEqn) -> bool:
    return all(np.issubdtype(o.aval.dtype, np.inexact) for o in eqn.outvars)
