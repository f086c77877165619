"""``memsafe.jit``: the public API. A :class:`MemsafeFunction` plans a verified program per set
of argument shapes (:mod:`memsafe.build`), runs it, and differentiates it with a gradient program
of its own (:mod:`memsafe.backward`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from memsafe import _jax, build, stages
from memsafe.arguments import ArgSpec, Call
from memsafe.backward import Backward, backward_program
from memsafe.batching import BatchedProgram
from memsafe.dispatch import MISS, FastPath
from memsafe.errors import ForwardModeError
from memsafe.gradient import differentiable
from memsafe.limits import format_bytes, parse_limit
from memsafe.plan import Plan
from memsafe.program import Program
from memsafe.search import Hint
from memsafe.split.strategies.sharded import mesh


class MemsafeFunction:
    """A function compiled under a memory limit; call it like a ``jax.jit`` function.

    Made by :func:`memsafe.jit`, whose arguments it keeps as attributes (``memory_limit`` in
    bytes). ``__wrapped__`` is the original function; name and docstring are copied from it.
    """

    def __init__(
        self,
        fun: Callable[..., Any],
        memory_limit: int | float | str,
        static_argnums: int | Sequence[int] = (),
        static_argnames: str | Sequence[str] = (),
        donate_argnums: int | Sequence[int] = (),
        donate_argnames: str | Sequence[str] = (),
        compiler_options: Mapping[str, Any] | None = None,
        progress: bool | None = None,
        mesh: Any = None,
    ) -> None:
        self.fun = fun
        self.mesh = mesh
        self.memory_limit = parse_limit(memory_limit)
        self._spec = ArgSpec.infer(
            fun, static_argnums, static_argnames, donate_argnums, donate_argnames
        )
        self.static_argnums = self._spec.static_argnums
        self.static_argnames = self._spec.static_argnames
        self.donate_argnums = self._spec.donate_argnums
        self.donate_argnames = self._spec.donate_argnames
        self.compiler_options = dict(compiler_options or {})
        self.progress = progress
        self._build_options = {"compiler_options": self.compiler_options, "progress": progress}
        self._programs: dict[Any, Program] = {}
        self._hints: dict[Any, Hint] = {}  # the latest plan of each program at other shapes
        self._backward: dict[Any, Backward] = {}
        self._latest_backward: dict[Any, Program] = {}
        self._batched_programs: dict[Any, BatchedProgram] = {}
        self._warned = [False]  # the outer-jit warning, given once (memsafe.batching)
        static = self._spec.static_argnums or self._spec.static_argnames
        self._fast = None if static else FastPath()  # calls of programs already verified
        functools.update_wrapper(self, fun)

    # -- argument handling -------------------------------------------------------------------

    def _planned(self, args: tuple, kwargs: dict) -> tuple[Program, Call]:
        """The verified program for this call's arguments (planned on first sight), and the call."""
        call = self._spec.split(args, kwargs)
        on_mesh = self._on_mesh(call.flat)
        program = self._programs.get(self._key(call, on_mesh))
        if program is None:
            avals = call.avals if on_mesh is None else on_mesh.given(call.avals, call.flat)
            program = build.build_program(
                call.rebuild,
                avals,
                self.memory_limit,
                call.donate,
                self._name,
                on_mesh=on_mesh,
                hint=self._hints.get(call.family),
                **self._build_options,
            )
            self._hints[call.family] = Hint.of(program) or self._hints.get(call.family)
            # the user's output structure
            program = dataclasses.replace(program, out_tree=call.out_tree[0])
            self._programs[self._key(call, on_mesh)] = program
        return program, call

    def _on_mesh(self, flat: Sequence[Any]) -> mesh.MeshPlan | None:
        """The mesh this call runs on (memsafe.split.strategies.sharded.mesh.resolve), None for one
        device."""
        found = mesh.resolve(self.mesh, flat)
        return None if found is None else mesh.MeshPlan(found)

    @staticmethod
    def _key(call: Call, on_mesh: mesh.MeshPlan | None) -> Any:
        return call.key if on_mesh is None else (call.key, on_mesh)

    def _program(self, args: tuple, kwargs: dict) -> tuple[Program, list[Any], Callable, Any]:
        program, call = self._planned(args, kwargs)
        return program, call.flat, call.rebuild, self._key(call, program.on_mesh)

    @property
    def _name(self) -> str:
        return getattr(self.fun, "__name__", repr(self.fun))

    # -- public API --------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._fast is not None:
            outs = self._fast.call(args, kwargs)
            if outs is not MISS:
                return outs
        program, flat, rebuild, key = self._program(args, kwargs)
        if any(_jax.is_forward_mode_tracer(x) for x in flat):
            raise ForwardModeError(self._name)
        if any(_jax.is_tracer(x) for x in flat):
            outs = self._differentiable(program, rebuild, key)(*flat)
        else:
            outs = program.run(flat)
            if self._fast is not None and program.on_mesh is None and program.settled:
                self._fast.remember(args, kwargs, program)  # (a mesh places arguments)
        return jax.tree_util.tree_unflatten(program.out_tree, list(outs))

    def __repr__(self) -> str:
        parts = [self._name, f"memory_limit={format_bytes(self.memory_limit)}"]
        for attr in ("static_argnums", "static_argnames", "donate_argnums", "donate_argnames"):
            if getattr(self, attr):
                parts.append(f"{attr}={getattr(self, attr)!r}")
        if self.compiler_options:
            parts.append(f"compiler_options={self.compiler_options!r}")
        plans = len(self._programs)
        parts.append(f"{plans} plan{'s' if plans != 1 else ''}")
        return f"memsafe.jit({', '.join(parts)})"

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        """As a method: bind ``obj`` as the first argument, as ``jax.jit`` functions do."""
        if obj is None:
            return self
        return functools.partial(self, obj)

    def plan(self, *args: Any, **kwargs: Any) -> Plan:
        """What was done for these arguments (arrays or ShapeDtypeStructs).

        Args:
            *args: the arguments as for a call; arrays may be ``jax.ShapeDtypeStruct``.
            **kwargs: keyword arguments as for a call.

        Returns:
            The :class:`memsafe.Plan` (with ``backward`` set once a gradient was planned).

        Raises:
            memsafe.MemoryLimitError: no rewrite meets the limit.
        """
        program, _, _, key = self._program(args, kwargs)
        backward = self._latest_backward.get(key)
        if backward is not None:
            program.plan.backward = backward.plan
        return program.plan

    def trace(self, *args: Any, **kwargs: Any) -> stages.Traced:
        """Trace and plan for these arguments, as ``jax.jit(f).trace`` (the program is verified,
        so this compiles it). ``.jaxpr`` is the program that runs; ``.lower()`` continues.

        Example:
            >>> traced = f_safe.trace(x, k=10)
            >>> compiled = traced.lower().compile()
            >>> compiled(x)   # static arguments left out, as in JAX (or repeated)
        """
        program, call = self._planned(args, kwargs)
        return stages.Traced(self._spec, call, program)

    def lower(self, *args: Any, **kwargs: Any) -> stages.Lowered:
        """The verified program lowered for these arguments, as ``jax.jit(f).lower``;
        ``.compile()`` returns the executable memsafe measured, called with the same pytrees."""
        return self.trace(*args, **kwargs).lower()

    def eval_shape(self, *args: Any, **kwargs: Any) -> Any:
        """The outputs' shapes and dtypes (``jax.ShapeDtypeStruct`` pytree), as
        ``jax.eval_shape``: traced only, nothing is planned or compiled."""
        call = self._spec.split(args, kwargs)
        outs = jax.eval_shape(call.rebuild, *call.avals)
        return jax.tree_util.tree_unflatten(call.out_tree[0], outs)

    def backward_plan(
        self, *args: Any, argnums: int | Sequence[int] | None = None, **kwargs: Any
    ) -> Plan:
        """The plan of the gradient program for these arguments.

        Args:
            *args: the arguments as for a call; arrays may be ``jax.ShapeDtypeStruct``.
            argnums: the positional arguments differentiated, as ``jax.grad``'s ``argnums``
                (the program ``jax.grad`` runs: a scalar output's cotangent is its seed 1.0).
                Left out: the gradient program that ran last for these arguments (the inputs
                ``jax.grad`` perturbed, the cotangents it passed), or, before any ran, the
                gradient w.r.t. every floating-point input.
            **kwargs: keyword arguments as for a call.

        Returns:
            The :class:`memsafe.Plan` of the backward program.

        Raises:
            memsafe.MemoryLimitError: no rewrite meets the limit.
            ValueError: ``argnums`` names no dynamic positional argument.
        """
        program, _, rebuild, key = self._program(args, kwargs)
        if argnums is None:
            ran = self._latest_backward.get(key)
            return (ran or self._backward_program(program, rebuild, key).program).plan
        perturbed = self._spec.flags(args, kwargs, argnums)
        outs = [v.aval for v in program.closed.jaxpr.outvars]
        seeded = len(outs) == 1 and outs[0].shape == () and _floating(outs[0].dtype)
        units = (True,) if seeded else None
        return self._backward_program(program, rebuild, key, perturbed, None, units).program.plan

    # -- differentiation ---------------------------------------------------------------------

    def _backward_program(
        self,
        program: Program,
        rebuild: Callable,
        key: Any,
        perturbed: tuple[bool, ...] | None = None,
        nonzero: tuple[bool, ...] | None = None,
        units: tuple[bool, ...] | None = None,
    ) -> Backward:
        """The VJP program of ``program`` (memsafe.backward), cached: gradients of the
        ``perturbed`` float inputs (default all) from the ``nonzero`` output cotangents (default
        all), which are its arguments after the primal inputs except the ``units``, the scalar
        1.0 built in (default none)."""
        perturbed = perturbed or (True,) * len(program.avals)
        nonzero = nonzero or (True,) * len(program.closed.jaxpr.outvars)
        units = units or (False,) * len(nonzero)
        found = self._backward.get((key, perturbed, nonzero, units))
        if found is None:
            found = backward_program(
                program,
                rebuild,
                self.memory_limit,
                self._name,
                self._build_options,
                perturbed,
                nonzero,
                units,
            )
            self._backward[(key, perturbed, nonzero, units)] = found
            self._latest_backward[key] = found.program  # shown by plan()
        return found

    def _batched(self, program: Program, source: Callable, key: Any) -> BatchedProgram:
        """``program``, planned from ``source``, as a :class:`BatchedProgram` (re-planned under
        ``jax.vmap``), cached."""
        found = self._batched_programs.get(key)
        if found is None or found.program is not program:
            found = BatchedProgram(source, program, self._build, self._name, self._warned)
            self._batched_programs[key] = found
        return found

    def _build(self, flat_fun: Callable, avals: Sequence[Any], name: str) -> Program:
        return build.build_program(
            flat_fun, avals, self.memory_limit, (), name, **self._build_options
        )

    def _differentiable(self, program: Program, rebuild: Callable, key: Any) -> Callable:
        """The program as a custom_vjp whose backward pass is its own memory-safe program, and
        whose forward and backward re-plan under ``jax.vmap`` (memsafe.gradient)."""

        def backward_for(
            perturbed: tuple[bool, ...], nonzero: tuple[bool, ...], units: tuple[bool, ...]
        ) -> tuple[BatchedProgram, list[int]]:
            backward = self._backward_program(program, rebuild, key, perturbed, nonzero, units)
            batched = self._batched(
                backward.program,
                backward.program.source,
                ("backward", key, perturbed, nonzero, units),
            )
            return batched, list(backward.diff_positions)

        return differentiable(self._batched(program, rebuild, key), backward_for)


def _floating(dtype: Any) -> bool:
    return bool(jax.numpy.issubdtype(dtype, jax.numpy.floating))


def jit(
    fun: Callable[..., Any] | None = None,
    *,
    memory_limit: int | float | str,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    compiler_options: Mapping[str, Any] | None = None,
    progress: bool | None = None,
    mesh: Any = None,
) -> Any:
    """Compile ``fun`` so that its whole footprint (arguments + outputs + temporaries - aliases +
    constants) stays under ``memory_limit``, splitting large intermediates into sequential chunks.

    Usable as ``memsafe.jit(f, memory_limit="1GiB")`` or as a decorator with keyword arguments.

    Args:
        fun: the function, as for ``jax.jit``; omit it to get a decorator.
        memory_limit: bytes (an int, or a float that is a whole number) or a size string
            (``"512MiB"``, ``"2GB"``, ``"1.5GiB"``); see :func:`memsafe.parse_limit`.
        static_argnums: positions of arguments that are hashable Python values; completed with
            their names through ``fun``'s signature, as ``jax.jit`` does, so they may be passed
            by position or keyword.
        static_argnames: names of static arguments, completed with their positions likewise.
        donate_argnums: positions of arguments whose buffers XLA may reuse for outputs.
        donate_argnames: names of donated arguments.
        compiler_options: XLA options for every compile, merged with memsafe's (on the CPU,
            YNNPACK fusions off); an option given here wins over memsafe's.
        progress: show a one-line progress display on stderr for plans longer than about two
            seconds; None (default) reads the environment variable ``MEMSAFE_PROGRESS=1``.
        mesh: a ``jax.sharding.Mesh`` to run on, with ``memory_limit`` per device: the split
            axes are sharded over its devices (memsafe.split.strategies.sharded.mesh). None
            (default): the mesh set with ``jax.set_mesh``, else the one the arguments'
            ``NamedSharding`` carry, else one device.

    Returns:
        A :class:`MemsafeFunction` (or, without ``fun``, a decorator making one).

    Raises:
        TypeError: ``fun`` is not callable, or an argnum/argname has the wrong type.
        ValueError: a bad ``memory_limit``, or an argnum/argname ``fun`` has no parameter for.
        memsafe.MemoryLimitError: (at the first call for some argument shapes) no rewrite meets
            the limit.

    Example:
        >>> knn_safe = memsafe.jit(knn, memory_limit="1GiB", static_argnames="k")
        >>> dist, idx = knn_safe(x, y, k=10)
    """
    options = {
        "memory_limit": memory_limit,
        "static_argnums": static_argnums,
        "static_argnames": static_argnames,
        "donate_argnums": donate_argnums,
        "donate_argnames": donate_argnames,
        "compiler_options": compiler_options,
        "progress": progress,
        "mesh": mesh,
    }
    if fun is None:
        parse_limit(memory_limit)  # a bad limit is an error at the decorator already
        return functools.partial(jit, **options)
    if not callable(fun):
        raise TypeError(f"memsafe.jit expects a callable, got {type(fun).__name__}")
    return MemsafeFunction(fun, **options)
