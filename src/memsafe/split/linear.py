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
from memsafe.primitives import Scaling, facts


class Role(enum.Enum):
    """What one operand of an equation is, as the split of a loop body sees it."""

    WHOLE = "whole"  # the same on every chunk (read whole, or computed from such values)
    ZERO = "zero"  # a literal zero, or a broadcast of one: adds nothing to a sum
    SHARE = "share"  # the chunk's share of a sum over the split axis
    SPLIT = "split"  # carries the split axis


#: Linear in one operand, the others read whole (a product, a contraction, a quotient by a
#: value read whole): the operand positions that may hold the share.
_ONE_OF: dict[str, tuple[int, ...]] = {"mul": (0, 1), "dot_general": (0, 1), "div": (0,)}
#: Linear in all of these positions jointly, the others read whole (indices, predicates): every
#: one must be a share or zero.
_ALL_OF: dict[str, slice] = {
    "concatenate": slice(None),
    "select_n": slice(1, None),
    "dynamic_slice": slice(0, 1),
    "dynamic_update_slice": slice(0, 2),
}
#: Linear, one operand, not in the primitive table's scaling facts.
_UNARY = frozenset({"reduce_sum", "slice", "rev", "cumsum"})


def keeps_sums(eqn: JaxprEqn, roles: Sequence[Role]) -> bool:
    """Whether ``eqn``'s results are shares of sums, given its operands' ``roles`` (at least
    one a share, none split)."""
    if Role.SPLIT in roles:
        return False
    name = eqn.primitive.name
    if name == "pad":  # linear in the operand when the padding value is zero
        return roles[0] is Role.SHARE and roles[1] is Role.ZERO
    if name in _ONE_OF:
        shares = [k for k, r in enumerate(roles) if r is Role.SHARE]
        return len(shares) == 1 and shares[0] in _ONE_OF[name]
    if name in _ALL_OF:
        return _all_of(roles, _ALL_OF[name])
    scaling = facts(name).scaling
    if scaling is Scaling.SAME:
        return _all_of(roles, slice(None))  # sums and differences (select_n is above)
    if scaling is Scaling.COMMUTES and not _inexact(eqn):
        return False  # a share converted to an integer no longer adds up
    return len(roles) == 1 and (scaling is not None or name in _UNARY)


def _all_of(roles: Sequence[Role], where: slice) -> bool:
    inside = set(range(len(roles))[where])
    return all(
        (r in (Role.SHARE, Role.ZERO)) if k in inside else r is Role.WHOLE
        for k, r in enumerate(roles)
    )


def _inexact(eqn: JaxprEqn) -> bool:
    return all(np.issubdtype(o.aval.dtype, np.inexact) for o in eqn.outvars)
