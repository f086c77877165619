"""The one module that touches JAX internals.

Everything memsafe needs from JAX beyond its public API (jaxpr classes, primitive objects, source
locations of equations, binding a primitive from a jaxpr equation) is imported or wrapped here, so a
JAX upgrade touches this file alone. Other modules import these names from ``memsafe._jax``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend.core as _jex_core
import numpy as np
from jax import core as _public_core
from jax._src import mesh as mesh_lib
from jax._src import source_info_util
from jax._src.array import ArrayImpl as _ArrayImpl
from jax._src.lax import lax as _lax_internal

from memsafe import primitives

# Jaxpr classes (jax.extend.core is the sanctioned home for these).
ClosedJaxpr = _jex_core.ClosedJaxpr
Jaxpr = _jex_core.Jaxpr
JaxprEqn = _jex_core.JaxprEqn
Literal = _jex_core.Literal
Var = _jex_core.Var
DropVar = _jex_core.DropVar
Primitive = _jex_core.Primitive
ShapedArray = _public_core.ShapedArray
eval_jaxpr = _public_core.eval_jaxpr
jaxpr_as_fun = _jex_core.jaxpr_as_fun
#: The type of concrete JAX arrays (never a tracer): what the dispatch fast path passes as is.
ConcreteArray = _ArrayImpl


#: Primitives that only wrap a sub-jaxpr and can be inlined for a forward (primal) program, those
#: with a differentiation rule of their own (memsafe differentiates the *original* function, so
#: inlining their primal bodies is exact for the forward program), and the calls that checkpoint
#: their body: facts of :data:`memsafe.primitives.TABLE`.
CALL_PRIMITIVES = primitives.CALLS
CUSTOM_DIFF_PRIMITIVES = primitives.CUSTOM_DIFF
REMAT_PRIMITIVES = primitives.REMATS


def inner_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The sub-jaxpr of a call-like equation (jit, remat, custom_jvp/vjp), as a ClosedJaxpr."""
    name = eqn.primitive.name
    if name in CALL_PRIMITIVES or name in CUSTOM_DIFF_PRIMITIVES:
        for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "call"):
            sub = eqn.params.get(key)
            if sub is None:
                continue
            if isinstance(sub, ClosedJaxpr):
                return sub
            if isinstance(sub, Jaxpr):
                return ClosedJaxpr(sub, ())
    return None


def implementation_jaxpr(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The jaxpr of a primitive defined outside JAX by its implementation, traced at ``eqn``'s
    operands: equinox's filter primitives (lineax's ``linear_solve``, under ``jax.vmap`` its
    ``vprim``) define ``impl`` as JAX code and lower by tracing it (``mlir.lower_fun``), so the
    jaxpr is what XLA compiles for the equation. None for JAX's own primitives (their ``impl``
    dispatches the primitive itself) and where tracing fails."""
    if not _implemented_outside_jax(eqn.primitive):
        return None
    impl = eqn.primitive.impl
    avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in eqn.invars]
    params = dict(eqn.params)
    try:
        closed = jax.make_jaxpr(lambda *xs: impl(*xs, **params))(*avals)
    except Exception:  # a rule that needs concrete values, or another JAX version's internals
        return None
    outs = closed.out_avals
    want = [v.aval for v in eqn.outvars]
    if len(outs) != len(want) or any(
        (a.shape, a.dtype) != (b.shape, b.dtype) for a, b in zip(outs, want)
    ):
        return None
    return closed


@functools.cache
def _implemented_outside_jax(primitive: Any) -> bool:
    """Whether ``primitive``'s implementation is a function of a module outside JAX (once per
    primitive: every equation of every program is asked)."""
    impl = getattr(primitive, "impl", None)
    fn = impl.func if isinstance(impl, functools.partial) else impl
    module = getattr(inspect.getmodule(fn), "__name__", "") if fn is not None else ""
    return bool(module) and module.split(".")[0] not in ("jax", "jaxlib")


def runs_primitive(jaxpr: Any, names: Any) -> bool:
    """Whether ``jaxpr`` (a Jaxpr or ClosedJaxpr), or a program one of its equations holds in its
    parameters (a call's body, a loop's, a branch), has an equation of a primitive in ``names``."""
    return any(
        eqn.primitive.name in names or any(runs_primitive(j, names) for j in jaxprs_in_params(eqn))
        for eqn in getattr(jaxpr, "jaxpr", jaxpr).eqns
    )


def checkpointed_like(eqn: JaxprEqn, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` under ``jax.checkpoint`` with ``eqn``'s policy where the call ``eqn`` is a remat
    (chunk bodies are, so that differentiating them stores nothing per chunk), else as it is."""
    if eqn.primitive.name not in REMAT_PRIMITIVES:
        return run
    p = eqn.params
    return jax.checkpoint(run, prevent_cse=p.get("prevent_cse", True), policy=p.get("policy"))


def call_again(eqn: JaxprEqn, invals: Sequence[Any], run: Callable[..., Any]) -> list[Any]:
    """``run`` (a function of the operands) called where the call-like ``eqn`` was,
    checkpointed like it (:func:`checkpointed_like`)."""
    with eqn_context(eqn):
        return list(checkpointed_like(eqn, run)(*invals))


def _bind_params(eqn: JaxprEqn) -> tuple[Sequence[Any], dict[str, Any]]:
    got = eqn.primitive.get_bind_params(eqn.params)
    if isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict):
        return got  # jax < 0.10: (subfuns, params)
    return (), got


@contextlib.contextmanager
def eqn_context(eqn: JaxprEqn) -> Iterator[None]:
    """Trace code under ``eqn``'s source location, so rewritten code keeps the user's lines.
    The mesh in context stays the current one: an equation re-bound inside ``shard_map``
    (memsafe.split.strategies.sharded.mesh) sees the manual mesh of the devices' shares, not the one
    it was traced in."""
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    current = mesh_lib.get_abstract_mesh()
    with (
        source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
        mesh_lib.use_abstract_mesh(current),
    ):
        yield


def _in_this_mesh(params: dict[str, Any]) -> dict[str, Any]:
    """``params`` with an output ``sharding`` over a mesh other than the current one dropped
    (an equation traced under ``jax.set_mesh``, re-bound inside ``shard_map``)."""
    sharding = params.get("sharding")
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh == mesh_lib.get_abstract_mesh():
        return params
    return {**params, "sharding": None}


def bind_eqn(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Apply ``eqn``'s primitive to ``invals`` exactly as ``jax.core.eval_jaxpr`` does."""
    subfuns, params = _bind_params(eqn)
    params = _in_this_mesh(params)
    with eqn_context(eqn):
        out = eqn.primitive.bind(*subfuns, *invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def source_line(eqn: JaxprEqn) -> str:
    """The user's source location of an equation, ``file:line (function)``, or ``""``."""
    try:
        from jax._src import source_info_util

        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - depends on JAX internals
        return ""


def nbytes_of_aval(aval: Any) -> int:
    """Bytes of a ShapedArray (0 for tokens and other non-array values)."""
    shape = getattr(aval, "shape", None)
    dtype = getattr(aval, "dtype", None)
    if shape is None or dtype is None:
        return 0
    try:
        itemsize = np.dtype(dtype).itemsize
    except TypeError:  # extended dtypes such as PRNG keys
        itemsize = getattr(dtype, "itemsize", 4)
    return int(math.prod(shape)) * int(itemsize)


def make_closed_jaxpr(fun: Callable[..., Any], avals: Sequence[Any]) -> tuple[ClosedJaxpr, Any]:
    """Trace ``fun`` at ``avals`` (ShapeDtypeStructs or arrays); returns the jaxpr and out tree."""
    closed, out_shape = jax.make_jaxpr(fun, return_shape=True)(*avals)
    return closed, jax.tree_util.tree_structure(out_shape)


def closure_hoisted(fun: Callable[..., Any], avals: Sequence[Any]) -> tuple[ClosedJaxpr, list[Any]]:
    """``fun`` traced at ``avals`` with the values it closes over (tracers of the trace it runs
    in included) taken as leading inputs instead of constants: the program, with no constants,
    and those values, to pass as its first operands (how ``lax.while_loop`` binds its bodies,
    for a loop bound directly as a primitive)."""
    closed, _ = make_closed_jaxpr(fun, avals)
    jaxpr = closed.jaxpr
    hoisted = jaxpr.replace(constvars=[], invars=[*jaxpr.constvars, *jaxpr.invars])
    return ClosedJaxpr(hoisted, []), list(closed.consts)


def is_var(atom: Any) -> bool:
    """Whether ``atom`` (an equation's operand) is a variable, not a literal."""
    return isinstance(atom, Var) and not isinstance(atom, Literal)


def is_tracer(x: Any) -> bool:
    return isinstance(x, _public_core.Tracer)


def is_forward_mode_tracer(x: Any) -> bool:
    """Whether ``x`` is traced by forward-mode differentiation (``jax.jvp``, ``jax.jacfwd``).

    Reverse mode (``jax.grad``, ``jax.vjp``) traces with JAX's linearize trace when
    ``jax_use_direct_linearize`` is on (the default since jax 0.7), so a JVP tracer then means
    forward mode; with the flag off reverse mode traces JVP tracers too and this returns False.
    """
    from jax._src.interpreters import ad

    return bool(jax.config.jax_use_direct_linearize) and isinstance(x, ad.JVPTracer)


def bind_eqn_with(eqn: JaxprEqn, invals: Sequence[Any], **params: Any) -> list[Any]:
    """Like :func:`bind_eqn` with some of ``eqn``'s params replaced (re-binding at a new shape)."""
    return bind_eqn(eqn.replace(params={**eqn.params, **params}), invals)


def carry_positions(eqn: JaxprEqn) -> range:
    """The operand positions of a ``while``'s or ``scan``'s carries (an empty range for any
    other equation): after a while's predicate and body constants, after a scan's constants."""
    if eqn.primitive.name == "while":
        return range(eqn.params["cond_nconsts"] + eqn.params["body_nconsts"], len(eqn.invars))
    if eqn.primitive.name == "scan":
        consts, carries = scan_counts(eqn.params)
        return range(consts, consts + carries)
    return range(0)


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
    """(constants, carries) among a ``scan`` equation's operands; the scanned inputs follow.

    jax 0.10 keeps the counts as ``num_consts`` and ``num_carry``; jax 0.11 as the structure
    ``ft_in`` (a FlatTree of the constants, the carries and the scanned inputs).
    """
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carry, _ = params["ft_in"].unpack()
    return len(consts), len(carry)


def scan_layout(
    params: dict[str, Any], consts: int, carry: int, operands: int, results: int
) -> dict[str, Any]:
    """The params of ``params``'s scan re-bound with ``consts`` constants, ``carry`` carries,
    ``operands`` operands in all and ``results`` results (carries first), in this JAX's form."""
    if "num_consts" in params:
        out: dict[str, Any] = {"num_consts": consts, "num_carry": carry}
        if "linear" in params:
            out["linear"] = (False,) * operands
        return out
    from jax._src import flattree as ft

    xs, ys = operands - consts - carry, results - carry
    return {
        "ft_in": ft.pack((ft.nones(consts), ft.nones(carry), ft.nones(xs))),
        "ft_out": ft.pack((ft.nones(carry), ft.nones(ys))),
    }


def dce(closed: ClosedJaxpr) -> ClosedJaxpr:
    """Drop equations whose results are unused (rewrites leave the replaced region dead).

    Inputs and constants are kept, so the signature does not change; effectful equations stay.
    """
    from jax._src.interpreters import partial_eval as pe

    jaxpr = closed.jaxpr
    new, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
    if len(new.invars) != len(jaxpr.invars) or len(new.constvars) != len(jaxpr.constvars):
        return closed  # pragma: no cover - signature changed; keep the program as it is
    return ClosedJaxpr(new, list(closed.consts))


def pruned(closed: ClosedJaxpr) -> tuple[ClosedJaxpr, list[bool]]:
    """``closed`` without the inputs its results do not read (and the equations they do not
    need), and which of its inputs it keeps."""
    from jax._src.interpreters import partial_eval as pe

    jaxpr = closed.jaxpr
    new, used = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=False)
    if len(new.constvars) != len(jaxpr.constvars):  # pragma: no cover - keep it as it is
        return closed, [True] * len(jaxpr.invars)
    return ClosedJaxpr(new, list(closed.consts)), list(used)


def with_results(closed: ClosedJaxpr, results: Sequence[Any]) -> ClosedJaxpr:
    """``closed`` returning ``results`` (any of its values, its inputs included), the equations
    they do not need dropped; inputs and constants stay as they are."""
    jaxpr = closed.jaxpr.replace(outvars=list(results))
    return dce(ClosedJaxpr(jaxpr, list(closed.consts)))


def rewired(closed: ClosedJaxpr, results: Sequence[Any], given: Sequence[Var]) -> ClosedJaxpr:
    """``closed`` returning ``results`` (any of its values) with its values ``given`` taken as
    extra inputs after its own: the equations producing them dropped, and those nothing needs
    any more."""
    drop = set(given)
    eqns = [e for e in closed.jaxpr.eqns if not drop & set(e.outvars)]
    jaxpr = closed.jaxpr.replace(invars=[*closed.jaxpr.invars, *given], eqns=eqns)
    return with_results(ClosedJaxpr(jaxpr, list(closed.consts)), results)


def with_outputs(closed: ClosedJaxpr, keep: Sequence[int]) -> ClosedJaxpr:
    """``closed`` computing only its results at positions ``keep`` (in that order), the
    equations no kept result needs dropped; inputs and constants stay as they are."""
    return with_results(closed, [closed.jaxpr.outvars[k] for k in keep])


def _exclude_memsafe_frames() -> None:
    """Make JAX's "user frame" skip memsafe's own files, so equations memsafe traces (the VJP
    program, rewritten regions) are attributed to the user's code, not to memsafe."""
    import os

    from jax._src import source_info_util

    here = os.path.dirname(os.path.abspath(__file__))
    source_info_util.register_exclusion(here + os.sep)
    # Frozen stdlib modules (``<frozen runpy>`` under ``python -m``) are not the user's code;
    # the demo's functions stand for a user's and keep their lines.
    source_info_util.register_exclusion("<frozen ")
    include = getattr(source_info_util, "register_inclusion", None)
    if include is not None:
        include(os.path.join(here, "demo.py"))


_exclude_memsafe_frames()


def lowering_platform() -> str:
    """The platform name JAX lowers for on the default backend ('cpu', 'cuda', 'rocm', 'tpu')."""
    from jax._src import xla_bridge

    return xla_bridge.canonicalize_platform(jax.default_backend())


def platform_index_value(eqn: JaxprEqn, platform: str | None = None) -> int | None:
    """The index a ``platform_index`` equation (``lax.platform_dependent``, e.g. inside
    ``jnp.diagonal``) takes when lowered for ``platform`` (default: the default backend): the
    branch listing the platform, else the default (None) branch; None if not such an equation
    or no branch applies."""
    if eqn.primitive.name != "platform_index":
        return None
    platform = platform or lowering_platform()
    branches = eqn.params["platforms"]
    for i, names in enumerate(branches):
        if names is not None and platform in names:
            return i
    return next((i for i, names in enumerate(branches) if names is None), None)


#: Control-flow primitives and the parameter holding the programs they run (a loop's body; a
#: cond's branches, as a tuple).
LOOP_BODIES = {"scan": "jaxpr", "while": "body_jaxpr", "cond": "branches"}


def programs(eqn: JaxprEqn) -> tuple[ClosedJaxpr, ...]:
    """The programs a control-flow equation runs (see :data:`LOOP_BODIES`)."""
    held = eqn.params[LOOP_BODIES[eqn.primitive.name]]
    return held if isinstance(held, tuple) else (held,)


def trip_programs(eqn: JaxprEqn) -> tuple[ClosedJaxpr, ...]:
    """The programs a loop runs on each trip: its body, and a ``while``'s condition."""
    cond = eqn.params.get("cond_jaxpr")
    return programs(eqn) + ((cond,) if cond is not None else ())


def jaxprs_in_params(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """The jaxprs among ``eqn``'s parameters (a call's body, a loop's, a cond's branches)."""
    from jax._src import core

    return core.jaxprs_in_params(eqn.params)


def dtypes_in(jaxpr: Jaxpr) -> Iterator[Any]:
    """The dtypes of every value of ``jaxpr`` and of the jaxprs its equations run."""
    for var in jaxpr.invars:
        yield var.aval.dtype
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield getattr(var.aval, "dtype", None)
        for inner in jaxprs_in_params(eqn):
            yield from dtypes_in(inner)


def cond_branches(eqn: JaxprEqn) -> tuple[ClosedJaxpr, ...] | None:
    """The branch jaxprs of a ``cond`` equation (its first operand is the branch index)."""
    if eqn.primitive.name != "cond":
        return None
    return tuple(eqn.params["branches"])


def is_batch_tracer(x: Any) -> bool:
    """Whether ``x`` is a tracer of ``jax.vmap`` (as opposed to a staged trace such as jit's)."""
    from jax._src.interpreters import batching

    return isinstance(x, batching.BatchTracer)


def context_mesh() -> Any:
    """The concrete mesh set with ``jax.set_mesh`` (also under a trace, where the public
    ``jax.sharding.get_mesh`` refuses), or None when none is set."""
    from jax._src import mesh as mesh_lib

    got = mesh_lib.get_concrete_mesh()
    return None if got is None or got.empty else got


def lapack_waits_on_its_pool() -> bool:
    """Whether batched LAPACK calls can wait for each other forever here: jaxlib 0.10's CPU
    kernels cut a batch into pieces, schedule them on XLA's intra-op thread pool and wait for
    them on a thread of that same pool, so calls running at once can hold every thread while
    their pieces wait in the queue. jaxlib 0.11 runs each call on its calling thread."""
    import jaxlib

    version = tuple(int(p) for p in jaxlib.__version__.split(".")[:2] if p.isdigit())
    return (0, 10) <= version < (0, 11) and lowering_platform() == "cpu"


def serialize_executable(compiled: Any) -> bytes:
    """``compiled`` (a ``jax.stages.Compiled``) as bytes that :func:`load_executable` turns back
    into an executable in another process of the same jaxlib, backend and devices.

    Args:
        compiled: what ``jax.jit(...).lower(...).compile()`` returned.

    Returns:
        The executable (XLA's serialization) with its argument and result trees, pickled.

    Raises:
        ValueError, NotImplementedError: what ``jax.experimental.serialize_executable`` refuses
            (a backend that cannot serialize, constants passed as arguments, mutable arrays).
    """
    import pickle

    from jax.experimental import serialize_executable

    payload, in_tree, out_tree = serialize_executable.serialize(compiled)
    return pickle.dumps((payload, in_tree, out_tree))


def load_executable(data: bytes) -> Any:
    """The executable :func:`serialize_executable` wrote, loaded onto the default backend's
    devices: a ``jax.stages.Compiled`` (callable, with ``memory_analysis()``), not compiled again.

    Args:
        data: bytes from :func:`serialize_executable`, read from a source only the user writes
            (loading an executable runs code it holds).

    Returns:
        The loaded executable.

    Raises:
        Exception: whatever unpickling or XLA's loader raises for bytes it cannot load
            (truncated, corrupt, another jaxlib's).
    """
    import pickle

    from jax.experimental import serialize_executable

    payload, in_tree, out_tree = pickle.loads(data)
    return serialize_executable.deserialize_and_load(payload, in_tree, out_tree)


def topology_fingerprint() -> str:
    """A fingerprint of the default backend's devices and how they are connected (what JAX's
    own compilation cache keys on), or "" where the backend gives none."""
    from jax._src.lib import xla_client

    try:
        return str(xla_client.get_topology_for_devices(jax.devices()).fingerprint())
    except Exception:  # a backend without a serializable topology: device kinds cover it
        return ""


def weak_like(values: Sequence[Any], avals: Sequence[Any]) -> list[Any]:
    """``values`` (traced results of a rewritten program) made weakly typed where ``avals`` (the
    original program's results) are: a result built anew (a chunk loop's counter) loses the weak
    type of a Python scalar it started from, which changes how it promotes afterwards."""

    def weak(v: Any) -> bool:
        return bool(getattr(getattr(v, "aval", v), "weak_type", False))

    return [
        _lax_internal._convert_element_type(v, None, weak_type=True)
        if weak(a) and not weak(v)
        else v
        for v, a in zip(values, avals)
    ]
