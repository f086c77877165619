"""The gradient program of a memsafe function: its VJP, planned and verified under the same
memory limit as the forward (rewritten from an algebraically simplified forward where memory
needs it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import jax

from memsafe import _jax, build, passes
from memsafe.batching import planning
from memsafe.compiling import emit
from memsafe.context import PassContext
from memsafe.graph import inline_calls
from memsafe.pipeline import run_pass
from memsafe.plan import Plan
from memsafe.program import Program

#: How a backward program gets an output's cotangent: as an argument, or built in as zeros or
#: as ones (the scalar seed of ``jax.grad``).
GIVEN, ZERO, ONE = "given", "zero", "one"


@dataclass(frozen=True)
class Backward:
    """A verified gradient program and the primal inputs it differentiates.

    Attributes:
        program: the VJP program: arguments the primal inputs, then the nonzero cotangents;
            outputs the gradients of the inputs at ``diff_positions``. Its ``source`` is the VJP
            of the original forward (re-planned from it under ``jax.vmap``).
        diff_positions: the positions of the primal inputs differentiated.
    """

    program: Program
    diff_positions: tuple[int, ...]


def backward_program(
    forward: Program,
    rebuild: Callable[..., Any],
    memory_limit: int,
    name: str,
    build_options: Mapping[str, Any],
    perturbed: tuple[bool, ...],
    nonzero: tuple[bool, ...],
    units: tuple[bool, ...] | None = None,
) -> Backward:
    """The VJP of ``forward``, itself rewritten and verified under ``memory_limit``.

    Args:
        forward: the verified forward program.
        rebuild: the flat function it was planned from.
        memory_limit: bytes.
        name: the function's name (the backward is named "gradient of NAME").
        build_options: keyword arguments of :func:`memsafe.build.build_program`
            (``compiler_options``, ``progress``).
        perturbed: per primal input, whether its gradient is wanted (float inputs only).
        nonzero: per output, whether its cotangent is given (else zero).
        units: per output, whether its cotangent is the scalar 1.0, built into the program (the
            seed of ``jax.grad``: the program is then the one ``jax.jit(jax.grad(f))``
            compiles) rather than taken as an argument; default none.

    Returns:
        The :class:`Backward`.

    Raises:
        memsafe.MemoryLimitError: no rewrite of the gradient fits the limit.
    """
    avals = forward.avals
    outvars = forward.closed.jaxpr.outvars
    units = units or (False,) * len(nonzero)
    kinds = [ONE if unit else GIVEN if keep else ZERO for keep, unit in zip(nonzero, units)]
    out_avals = [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
        for v, kind in zip(outvars, kinds)
        if kind == GIVEN
    ]
    diff = tuple(
        i
        for i, (a, p) in enumerate(zip(avals, perturbed))
        if p and jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)
    )
    outs = [(v.aval.shape, v.aval.dtype, kind) for v, kind in zip(outvars, kinds)]
    simplified, rewrites = algebraic_forward(rebuild, avals, memory_limit)
    # The original gradient when it fits; the rewritten forward's only where memory needs it.
    program = build.build_program(
        vjp_of(rebuild, len(avals), diff, outs),
        (*avals, *out_avals),
        memory_limit,
        (),
        f"gradient of {name}",
        rewrite_from=vjp_of(simplified, len(avals), diff, outs),
        on_mesh=forward.on_mesh,
        **build_options,
    )
    if not program.plan.fits_unchanged:
        program.plan.records[:0] = rewrites
    program = replace(program, source=vjp_of(rebuild, len(avals), diff, outs))
    return Backward(program, diff)


def vjp_of(
    forward: Callable[..., list[Any]],
    n_in: int,
    diff: Sequence[int],
    outs: Sequence[tuple[tuple[int, ...], Any, str]],
) -> Callable[..., list[Any]]:
    """The flat VJP function of ``forward``: arguments its ``n_in`` primal inputs, then the
    cotangents of the outputs ``outs`` marks given ((shape, dtype, kind) per output: ``GIVEN``,
    ``ZERO`` or ``ONE``, the last two built in); outputs the gradients of the inputs at
    ``diff``."""

    def vjp_fun(*flat: Any) -> list[Any]:
        primals, given = flat[:n_in], iter(flat[n_in:])
        made = {ZERO: jax.numpy.zeros, ONE: jax.numpy.ones}
        cts = [
            next(given) if kind == GIVEN else made[kind](shape, dtype)
            for shape, dtype, kind in outs
        ]

        def of_diff(*d: Any) -> list[Any]:
            full = list(primals)
            for i, v in zip(diff, d):
                full[i] = v
            return forward(*full)

        _, pullback = jax.vjp(of_diff, *[primals[i] for i in diff])
        return list(pullback(cts))

    return vjp_fun


@planning
def algebraic_forward(
    fun: Callable[..., Any], avals: Sequence[jax.ShapeDtypeStruct], memory_limit: int
) -> tuple[Callable[..., list[Any]], list[Any]]:
    """``fun`` with the algebraic passes (``passes.ALGEBRAIC``: rewrites into cheaper equivalents
    whatever the limit) applied and custom derivative rules kept, ready to differentiate; and the
    records of the rewrites that fired. The gradient is taken of the program they produce, so
    the backward program benefits from them too: differentiating ``|x|^2 + |y|^2 - 2 x y^T``
    needs no n*m*d value."""
    closed, _ = _jax.make_closed_jaxpr(fun, avals)
    program = inline_calls(closed, keep_custom_derivatives=True)
    ctx = PassContext(
        memory_limit=memory_limit,
        fixed_bytes=0,
        plan=Plan(memory_limit),
        keep_custom_derivatives=True,
    )
    for name, run in passes.named_passes(passes.ALGEBRAIC):
        program = run_pass(name, run, program, ctx, getattr(fun, "__name__", "function"))
    return emit(program, closed.out_avals), ctx.plan.records
