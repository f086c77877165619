"""``memsafe.jit``: trace, rewrite under a memory limit, verify with XLA, and run.

The driver only orders passes and verifies; the passes do the rewriting (memsafe.passes).
"""

from __future__ import annotations

import functools
import inspect as _inspect
import os
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from memsafe import _jax, passes
from memsafe.errors import MemoryLimitError
from memsafe.graph import Graph, inline_calls
from memsafe.limits import format_bytes, parse_limit
from memsafe.passes import PassContext
from memsafe.plan import Attempt, PassRecord, Plan
from memsafe.xla import Footprint, hidden_constant_bytes, memsafe_jit

#: How many compile-and-verify rounds the driver tries, shrinking chunk sizes each time.
MAX_ATTEMPTS = 6
#: The first retry shrinks the chunk budget by the excess with a margin (at least by
#: FIRST_SHRINK); later ones at least halve it, so that six rounds reach small chunks.
FIRST_SHRINK = 0.8
SHRINK_MARGIN = 0.9

#: Passes that rewrite expressions into cheaper equivalents whatever the limit. The gradient is
#: taken of the program they produce (custom derivative rules kept), so the backward program
#: benefits from them too: differentiating ``|x|^2 + |y|^2 - 2 x y^T`` needs no n*m*d value.
ALGEBRAIC_PASSES = ("match_replace", "reorder")


@dataclass
class Program:
    """A verified program for one set of argument shapes."""

    jitted: Any  # jax.jit-wrapped function of the flat dynamic arguments
    fun: Callable[..., Any]  # the same, unjitted: what runs inside an outer trace (jit, grad)
    avals: tuple[jax.ShapeDtypeStruct, ...]
    out_tree: Any
    plan: Plan
    closed: _jax.ClosedJaxpr  # the program that runs (original when it fits unchanged)
    compiled: Any = None  # the verified executable, called directly to avoid a second compile

    def run(self, flat: Sequence[Any]) -> Any:
        """Run on concrete arrays: the verified executable, or jit's path for odd argument types."""
        if self.compiled is not None:
            try:
                return self.compiled(*flat)
            except (TypeError, ValueError):
                pass  # e.g. Python scalars or arrays on another device: let jit convert them
        return self.jitted(*flat)

    def call(self, flat: Sequence[Any]) -> Any:
        """Run inside or outside a trace: the compiled program on concrete arrays (e.g. the
        forward and backward of ``jax.grad`` without an outer jit), else the traceable one."""
        if any(_jax.is_tracer(x) for x in flat):
            return self.fun(*flat)
        return self.run(flat)


def _is_static_leaf(x: Any) -> bool:
    """Leaves that are not arrays (strings, callables, None) are static, as in memsafe.inspect."""
    arraylike = jax.Array | np.ndarray | np.generic | float | int | complex | bool
    return not isinstance(x, arraylike | jax.ShapeDtypeStruct)


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    """The abstract value jax.jit would see, keeping Python scalars weakly typed."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    if isinstance(x, float | int | complex | bool) and not isinstance(x, np.generic):
        return jax.ShapeDtypeStruct((), jax.numpy.asarray(x).dtype, weak_type=True)
    arr = x if hasattr(x, "shape") and hasattr(x, "dtype") else np.asarray(x)
    return jax.ShapeDtypeStruct(
        tuple(arr.shape), arr.dtype, weak_type=getattr(x, "weak_type", False)
    )


def _emit(closed: _jax.ClosedJaxpr) -> Callable[..., list[Any]]:
    """A plain JAX function that runs ``closed`` (used to jit and to differentiate)."""

    def run(*flat: Any) -> list[Any]:
        return _jax.eval_jaxpr(closed.jaxpr, closed.consts, *flat)

    return run


def _trace(
    fun: Callable[..., Any], avals: Sequence[jax.ShapeDtypeStruct], name: str
) -> tuple[_jax.ClosedJaxpr, Any]:
    """``fun`` traced at ``avals``; the user's own error is kept as it is, noting where."""
    try:
        return _jax.make_closed_jaxpr(fun, avals)
    except Exception as err:
        shapes = ", ".join(f"{a.dtype}{list(a.shape)}" for a in avals)
        err.add_note(f"memsafe: while tracing {name} at arguments ({shapes})")
        raise


def build_program(
    flat_fun: Callable[..., Any],
    avals: Sequence[jax.ShapeDtypeStruct],
    memory_limit: int,
    donate: tuple[int, ...] = (),
    name: str = "function",
    rewrite_from: Callable[..., Any] | None = None,
) -> Program:
    """Trace ``flat_fun`` at ``avals`` and return a program verified to fit ``memory_limit``.

    The original program is returned, unchanged, when it fits. Otherwise the passes rewrite
    ``rewrite_from`` (default ``flat_fun``: an equivalent start, such as the gradient of an
    algebraically rewritten forward), shrinking chunks until a compile fits.
    Raises :class:`MemoryLimitError` when no rewrite brings the footprint under the limit."""
    closed, out_tree = _trace(flat_fun, avals, name)
    plan = Plan(memory_limit=memory_limit)
    hidden = hidden_constant_bytes(closed.consts)
    original = memsafe_jit(flat_fun, donate_argnums=donate)
    original_compiled = original.lower(*avals).compile()
    before = plan.before = Footprint.from_compiled(original_compiled, hidden)
    if before.total <= memory_limit:
        plan.fits_unchanged = True
        plan.after = before
        plan.attempts.append(Attempt(1.0, before, True, "original program"))
        return Program(original, flat_fun, tuple(avals), out_tree, plan, closed, original_compiled)
    fixed = before.arguments + before.outputs - before.aliases
    if fixed > memory_limit:
        raise MemoryLimitError(
            f"{name}: its arguments and outputs alone need {format_bytes(fixed)} "
            f"(arguments {format_bytes(before.arguments)}, outputs {format_bytes(before.outputs)}),"
            f" more than the limit; no rewrite can shrink them",
            limit=memory_limit,
            footprint=before.total,
        )
    start = closed if rewrite_from is None else _trace(rewrite_from, avals, name)[0]
    return _search(inline_calls(start), avals, out_tree, plan, fixed + hidden, donate, name)


def _search(
    flat: _jax.ClosedJaxpr,
    avals: Sequence[jax.ShapeDtypeStruct],
    out_tree: Any,
    plan: Plan,
    fixed: int,
    donate: tuple[int, ...],
    name: str,
) -> Program:
    """Run the passes on ``flat`` and verify, with smaller chunks each round, until it fits."""
    memory_limit, before = plan.memory_limit, plan.before
    scale, best, blockers = 1.0, None, []
    for attempt in range(MAX_ATTEMPTS):
        attempt_plan = Plan(memory_limit=memory_limit, before=before)
        ctx = PassContext(memory_limit, fixed, attempt_plan, chunk_scale=scale)
        program = flat
        for pass_name, run in passes.named_passes():
            program = _run_pass(pass_name, run, program, ctx, name)
        blockers = ctx.blockers
        emitted = _emit(program)
        jitted = memsafe_jit(emitted, donate_argnums=donate)
        compiled = jitted.lower(*avals).compile()
        after = Footprint.from_compiled(compiled, hidden_constant_bytes(program.consts))
        fits = after.total <= memory_limit
        plan.attempts.append(Attempt(scale, after, fits))
        best = after if best is None or after.total < best.total else best
        if fits:
            plan.records, plan.after = attempt_plan.records, after
            return Program(jitted, emitted, tuple(avals), out_tree, plan, program, compiled)
        if not attempt_plan.splits:
            break  # nothing size-dependent was done: smaller chunks cannot help
        # Shrink in proportion to the excess (chunk temps scale about linearly), with a margin;
        # halving outright cost the 10k x 1M kNN 2x its loop count after a 4% overshoot.
        room = max(1, memory_limit - (before.arguments + before.outputs - before.aliases))
        at_most = FIRST_SHRINK if attempt == 0 else 0.5
        scale *= min(at_most, SHRINK_MARGIN * room / (room + after.total - memory_limit))
    detail = ", ".join(
        f"{v.dtype}{list(v.shape)} ({format_bytes(v.bytes)})" for v in Graph(flat).largest(3)
    )
    raise MemoryLimitError(
        f"{name}: no rewrite brought the footprint under the limit "
        f"(largest intermediates: {detail})",
        limit=memory_limit,
        footprint=None if best is None else best.total,
        blockers=blockers,
        minimum=before.total if best is None else min(best.total, before.total),
    )


class MemsafeFunction:
    """A function compiled under a memory limit; call it like a ``jax.jit`` function."""

    def __init__(
        self,
        fun: Callable[..., Any],
        memory_limit: int | str,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (),
    ) -> None:
        self.fun = fun
        self.memory_limit = parse_limit(memory_limit)
        self.static_argnums = _as_tuple(static_argnums)
        self.static_argnames = _as_tuple(static_argnames)
        self.donate_argnums = _as_tuple(donate_argnums)
        self._signature = _signature_or_none(fun)
        self._programs: dict[Any, Program] = {}
        self._backward: dict[Any, Program] = {}
        functools.update_wrapper(self, fun)

    # -- argument handling -------------------------------------------------------------------

    def _split_args(self, args: tuple, kwargs: dict) -> tuple[Any, list[Any], Any, Any]:
        """Separate static from dynamic arguments; returns (key, flat dynamic, treedef, rebuild)."""
        static_pos = {i % len(args) for i in self.static_argnums if -len(args) <= i < len(args)}
        if self._signature is not None and self.static_argnames:
            names = list(self._signature.parameters)
            static_pos |= {names.index(n) for n in self.static_argnames if n in names[: len(args)]}
        static_args = tuple((i, args[i]) for i in sorted(static_pos))
        static_kwargs = tuple(
            sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)
        )
        dyn_args = [a for i, a in enumerate(args) if i not in static_pos]
        dyn_kwargs = {k: v for k, v in kwargs.items() if k not in self.static_argnames}
        leaves, treedef = jax.tree_util.tree_flatten((dyn_args, dyn_kwargs))
        # Non-array leaves are static too (a string, a callable, None).
        static_leaves = tuple((i, x) for i, x in enumerate(leaves) if _is_static_leaf(x))
        dyn_leaves = [x for x in leaves if not _is_static_leaf(x)]
        n_args = len(args)
        fun = self.fun
        out_tree: list[Any] = []

        def rebuild(*flat_dyn: Any) -> Any:
            it = iter(flat_dyn)
            static_map = dict(static_leaves)
            full = [static_map[i] if i in static_map else next(it) for i in range(len(leaves))]
            dargs, dkwargs = jax.tree_util.tree_unflatten(treedef, full)
            it_args = iter(dargs)
            smap = dict(static_args)
            call_args = [smap[i] if i in smap else next(it_args) for i in range(n_args)]
            out = fun(*call_args, **dkwargs, **dict(static_kwargs))
            leaves_out, tree = jax.tree_util.tree_flatten(out)
            out_tree[:] = [tree]
            return leaves_out

        rebuild.out_tree = out_tree  # type: ignore[attr-defined]

        avals = tuple(_aval(x) for x in dyn_leaves)
        try:
            key = (treedef, avals, static_args, static_kwargs, static_leaves)
            hash(key)
        except TypeError as err:
            raise TypeError(f"memsafe.jit: static arguments must be hashable ({err})") from err
        return key, dyn_leaves, rebuild, avals

    def _donate_flat(self, args: tuple) -> tuple[int, ...]:
        if not self.donate_argnums:
            return ()
        # Donation is positional over top-level arguments; map to flat leaf positions.
        out, pos = [], 0
        for i, a in enumerate(args):
            n = len(jax.tree_util.tree_leaves(a))
            if i in self.donate_argnums:
                out.extend(range(pos, pos + n))
            pos += n
        return tuple(out)

    def _program(self, args: tuple, kwargs: dict) -> tuple[Program, list[Any], Callable, Any]:
        key, flat, rebuild, avals = self._split_args(args, kwargs)
        program = self._programs.get(key)
        if program is None:
            program = build_program(
                rebuild, avals, self.memory_limit, self._donate_flat(args), self._name
            )
            program.out_tree = rebuild.out_tree[0]  # the user's output structure
            self._programs[key] = program
        return program, flat, rebuild, key

    @property
    def _name(self) -> str:
        return getattr(self.fun, "__name__", repr(self.fun))

    # -- public API --------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        program, flat, rebuild, key = self._program(args, kwargs)
        if any(_jax.is_tracer(x) for x in flat):
            outs = self._differentiable(program, rebuild, key)(*flat)
        else:
            outs = program.run(flat)
        return jax.tree_util.tree_unflatten(program.out_tree, list(outs))

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """What was done for these argument shapes (arrays or ShapeDtypeStructs)."""
        program, _, _, key = self._program(args, kwargs)
        backward = self._backward.get(key)
        if backward is not None:
            program.plan.backward = backward.plan
        return program.plan

    def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
        """The verified program's ``jax.stages.Lowered``, as ``jax.jit(f).lower`` returns."""
        program, _, _, _ = self._program(args, kwargs)
        return program.jitted.lower(*program.avals)

    def backward_plan(self, *args: Any, **kwargs: Any) -> Plan:
        """The plan of the gradient program (built on first differentiation, or now)."""
        program, _, rebuild, key = self._program(args, kwargs)
        return self._backward_program(program, rebuild, key).plan

    # -- differentiation ---------------------------------------------------------------------

    def _backward_program(self, program: Program, rebuild: Callable, key: Any) -> Program:
        """The VJP program, itself rewritten and verified under the memory limit."""
        found = self._backward.get(key)
        if found is not None:
            return found
        avals = program.avals
        out_avals = [
            jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in program.closed.jaxpr.outvars
        ]
        diff = [i for i, a in enumerate(avals) if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)]
        n_in = len(avals)

        forward, rewrites = _algebraic_forward(rebuild, avals, self.memory_limit)

        def vjp_of(forward: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
            def vjp_fun(*flat: Any) -> list[Any]:
                primals, cts = flat[:n_in], flat[n_in:]

                def of_diff(*d: Any) -> list[Any]:
                    full = list(primals)
                    for i, v in zip(diff, d):
                        full[i] = v
                    return forward(*full)

                _, pullback = jax.vjp(of_diff, *[primals[i] for i in diff])
                return list(pullback(list(cts)))

            return vjp_fun

        # The original gradient when it fits; the rewritten forward's only where memory needs it.
        backward = build_program(
            vjp_of(rebuild),
            (*avals, *out_avals),
            self.memory_limit,
            (),
            f"gradient of {self._name}",
            rewrite_from=vjp_of(forward),
        )
        if not backward.plan.fits_unchanged:
            backward.plan.records[:0] = rewrites
        backward.diff_positions = diff  # type: ignore[attr-defined]
        self._backward[key] = backward
        return backward

    def _differentiable(self, program: Program, rebuild: Callable, key: Any) -> Callable:
        """The program as a custom_vjp whose backward pass is its own memory-safe program."""
        memsafe_fun = self

        @jax.custom_vjp
        def call(*flat: Any) -> list[Any]:
            return list(program.call(flat))

        def fwd(*flat: Any) -> tuple[list[Any], tuple]:
            return list(program.call(flat)), flat

        def bwd(res: tuple, cts: list[Any]) -> tuple:
            backward = memsafe_fun._backward_program(program, rebuild, key)
            cts = [
                jax.numpy.zeros(v.aval.shape, v.aval.dtype) if _is_symbolic_zero(c) else c
                for c, v in zip(cts, program.closed.jaxpr.outvars)
            ]
            grads = backward.call([*res, *cts])
            out: list[Any] = [None] * len(res)
            for i, g in zip(backward.diff_positions, grads):  # type: ignore[attr-defined]
                out[i] = g
            return tuple(out)

        call.defvjp(fwd, bwd)
        return call


def _algebraic_forward(
    fun: Callable[..., Any], avals: Sequence[jax.ShapeDtypeStruct], memory_limit: int
) -> tuple[Callable[..., list[Any]], list[Any]]:
    """``fun`` with the algebraic passes applied and custom derivative rules kept, ready to
    differentiate; and the records of the rewrites that fired."""
    closed, _ = _jax.make_closed_jaxpr(fun, avals)
    program = inline_calls(closed, keep_custom_derivatives=True)
    ctx = PassContext(
        memory_limit=memory_limit,
        fixed_bytes=0,
        plan=Plan(memory_limit),
        keep_custom_derivatives=True,
    )
    for name, run in passes.named_passes():
        if name in ALGEBRAIC_PASSES:
            program = _run_pass(name, run, program, ctx, getattr(fun, "__name__", "function"))
    return _emit(program), ctx.plan.records


def strict() -> bool:
    """Whether a failing pass is an error (``MEMSAFE_STRICT=1``, as the test suite sets) rather
    than skipped with a warning."""
    return os.environ.get("MEMSAFE_STRICT") == "1"


def _run_pass(
    pass_name: str, run: Callable[..., Any], program: Any, ctx: PassContext, fun_name: str
) -> Any:
    """Run one pass; a pass that fails on a program it does not understand is skipped with a
    warning (passes only optimize: the program before it is still correct), and the driver's
    verification decides whether what remains fits. Under :func:`strict` the failure is
    re-raised with a note naming the pass and the function."""
    try:
        return run(program, ctx)
    except Exception as err:  # any failure of an optimization is survivable
        if strict():
            err.add_note(f"memsafe: in pass '{pass_name}' on {fun_name} (MEMSAFE_STRICT=1)")
            raise
        warnings.warn(
            f"memsafe: pass '{pass_name}' failed on {fun_name} and was skipped "
            f"({type(err).__name__}: {err})",
            RuntimeWarning,
            stacklevel=3,
        )
        ctx.record(PassRecord(pass_name, f"skipped: {type(err).__name__}: {err}"))
        return program


def _is_symbolic_zero(x: Any) -> bool:
    return x is None or type(x).__name__ in {"Zero", "SymbolicZero"}


def _as_tuple(x: Any) -> tuple:
    if x is None:
        return ()
    if isinstance(x, int | str):
        return (x,)
    return tuple(x)


def _signature_or_none(fun: Callable) -> _inspect.Signature | None:
    try:
        return _inspect.signature(fun)
    except (TypeError, ValueError):
        return None


def jit(
    fun: Callable[..., Any] | None = None,
    *,
    memory_limit: int | str,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
) -> Any:
    """Compile ``fun`` so that its whole footprint (arguments + outputs + temporaries - aliases +
    constants) stays under ``memory_limit``, splitting large intermediates into sequential chunks.

    Usable as ``memsafe.jit(f, memory_limit="1GiB")`` or as a decorator with keyword arguments.
    Raises :class:`memsafe.MemoryLimitError` when no rewrite meets the limit.
    """
    if fun is None:
        return functools.partial(
            jit,
            memory_limit=memory_limit,
            static_argnums=static_argnums,
            static_argnames=static_argnames,
            donate_argnums=donate_argnums,
        )
    if not callable(fun):
        raise TypeError(f"memsafe.jit expects a callable, got {type(fun).__name__}")
    return MemsafeFunction(fun, memory_limit, static_argnums, static_argnames, donate_argnums)
