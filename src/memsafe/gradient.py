"""A memsafe program as a ``jax.custom_vjp`` whose backward pass is its own verified program.

The rule is declared with ``symbolic_zeros=True``: the forward learns which inputs are
perturbed (``jax.grad(f, argnums=0)`` perturbs only the first) and the backward which output
cotangents are not symbolic zeros, so the backward program differentiates only what the caller
asked for and takes only the cotangents that exist; it needs no more than ``jax.jit``'s own
gradient for a value it would otherwise compute and throw away (a gradient w.r.t. a large
input nobody asked for).

A cotangent that is the concrete scalar 1.0 (the seed ``jax.grad`` and ``jax.value_and_grad``
pass for a scalar loss) is built into the backward program as a constant rather than taken as an
argument: the program is then the one ``jax.jit(jax.grad(f))`` compiles, and XLA folds what it
folds there (``1 - sum(ones) / n`` of a centered loss is 0 folded; taken at run time, XLA's
reciprocal and fused multiply-add made it 4e-6, fuzz seed 11524).

Primal, forward and backward run through :class:`memsafe.batching.BatchedProgram`, so ``vmap``
of a gradient and gradient of a ``vmap`` re-plan at the batched shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.custom_derivatives import SymbolicZero

from memsafe import _jax
from memsafe.batching import BatchedProgram

#: (perturbed inputs, non-zero output cotangents, cotangents that are the scalar 1.0) -> the
#: backward program for them, with the positions of the inputs it returns gradients for.
BackwardFor = Callable[
    [tuple[bool, ...], tuple[bool, ...], tuple[bool, ...]], tuple[BatchedProgram, list[int]]
]


@jax.tree_util.register_static
class _Perturbed:
    """Which inputs the forward saw perturbed, carried to the backward as static pytree data."""

    def __init__(self, flags: tuple[bool, ...]) -> None:
        self.flags = flags

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Perturbed) and other.flags == self.flags

    def __hash__(self) -> int:
        return hash(self.flags)


def differentiable(forward: BatchedProgram, backward_for: BackwardFor) -> Callable[..., Any]:
    """``forward`` as a function of its flat arguments that ``jax.grad``/``jax.vjp`` can
    differentiate, with ``backward_for`` giving the backward program.

    Args:
        forward: the verified forward program.
        backward_for: builds (or finds) the backward program for the perturbed inputs, the
            non-zero cotangents and those of them that are the scalar 1.0.

    Returns:
        A ``custom_vjp`` function of the flat arguments returning the list of flat outputs.
    """

    @jax.custom_vjp
    def call(*flat: Any) -> list[Any]:
        return forward(*flat)

    def fwd(*primals: Any) -> tuple[list[Any], tuple]:
        flat = [p.value for p in primals]
        perturbed = _Perturbed(tuple(bool(p.perturbed) for p in primals))
        return forward(*flat), (flat, perturbed)

    def bwd(res: tuple, cts: list[Any]) -> tuple:
        flat, perturbed = res
        nonzero = tuple(not _is_symbolic_zero(c) for c in cts)
        out: list[Any] = [None] * len(flat)
        if not any(nonzero):
            return tuple(out)
        units = tuple(keep and _is_unit(c) for c, keep in zip(cts, nonzero))
        backward, positions = backward_for(perturbed.flags, nonzero, units)
        if not positions:
            return tuple(out)
        given = [c for c, keep, unit in zip(cts, nonzero, units) if keep and not unit]
        for i, g in zip(positions, backward(*flat, *given)):
            out[i] = g
        return tuple(out)

    call.defvjp(fwd, bwd, symbolic_zeros=True)
    return call


def _is_symbolic_zero(x: Any) -> bool:
    return x is None or isinstance(x, SymbolicZero)


def _is_unit(x: Any) -> bool:
    """Whether a cotangent is the concrete floating-point scalar 1.0 (``jax.grad``'s seed)."""
    if _jax.is_tracer(x) or np.shape(x) != ():
        return False
    value = np.asarray(x)
    return bool(np.issubdtype(value.dtype, np.floating) and value == 1)
