"""Compile with XLA in a mode whose buffers it accounts for, and read the footprint.

The footprint memsafe bounds is the whole program's: arguments + outputs + temps - aliases, plus
generated code (folded constants) and closed-over constants that JAX passes as hidden arguments and
``memory_analysis()`` does not count at all.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from memsafe.limits import format_bytes

#: XLA's YNNPACK fusions on the CPU backend allocate buffers that ``memory_analysis()`` does not
#: count and slow Gaussian-kernel products 4-8x (measured on jax 0.10.2). memsafe compiles with
#: them off so the footprint it verifies is the footprint the process uses.
CPU_COMPILER_OPTIONS: dict[str, str] = {"xla_cpu_experimental_ynn_fusion_type": ""}


def _probe() -> bool:
    """Whether this jaxlib's CPU compiler knows the YNNPACK option (older ones reject it): a
    compile of a tiny program with it."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=CPU_COMPILER_OPTIONS).lower(1.0).compile()
        return True
    except Exception:
        return False


_probe_lock = threading.Lock()
_probe_done: list[Future[bool]] = []  # the one probe of this process, once started


def start_probe() -> None:
    """Start the probe of :func:`_cpu_option_supported` in a thread of its own, where the
    default backend is the CPU and it has not started: a plan calls this before it traces the
    user's function, so that the probe's compile (0.1-0.3 s) runs beside the trace."""
    if jax.default_backend() == "cpu" and os.environ.get("MEMSAFE_KEEP_YNN") is None:
        _probe_future()


def _probe_future() -> Future[bool]:
    with _probe_lock:
        if not _probe_done:
            future: Future[bool] = Future()
            _probe_done.append(future)

            def run() -> None:
                try:
                    future.set_result(_probe())
                except BaseException as err:  # never left pending
                    future.set_exception(err)

            threading.Thread(target=run, name="memsafe-probe", daemon=True).start()
        return _probe_done[0]


def _cpu_option_supported() -> bool:
    """Whether this jaxlib's CPU compiler knows the YNNPACK option (older ones reject it): the
    probe compile, once per process (started early by :func:`start_probe`)."""
    return _probe_future().result()


#: Names JAX gives a GPU backend.
GPU_BACKENDS = frozenset({"gpu", "cuda", "rocm"})


def compiler_options(backend: str | None = None) -> dict[str, str]:
    """Per-jit options memsafe compiles with on ``backend`` (default: JAX's default backend)."""
    backend = backend or jax.default_backend()
    if backend == "cpu" and os.environ.get("MEMSAFE_KEEP_YNN") is None and _cpu_option_supported():
        return dict(CPU_COMPILER_OPTIONS)
    if backend in GPU_BACKENDS:
        return dict(GPU_COMPILER_OPTIONS)
    return {}


#: XLA's fusion autotuner compares its own emitters with Triton's for each fusion while it
#: compiles. On an H100 with jax 0.11.2 it compiled one reduction fusion (``input_reduce_fusion``)
#: for minutes: past 140 s in a broadcast kNN's chunk program (256 x 1M x 64 differences), past
#: 60 s in jax.jit of Sinkhorn at n = m = 20,000, where the same programs compile in under a second
#: without it. memsafe compiles every program on a GPU without it (``compiler_options`` can turn
#: it back on); the kernel autotuner, which picks each GEMM's algorithm, stays on.
GPU_COMPILER_OPTIONS: dict[str, Any] = {"xla_gpu_experimental_enable_fusion_autotuner": False}


#: On a GPU, XLA's autotuner runs candidate kernels of each GEMM and fusion on buffers the size of
#: their operands and results while it compiles. Compiled only to read its footprint, a program
#: over the limit would then allocate its largest intermediates on the device (measured on an
#: H100 with jax 0.11.2: 32 GiB, attention's whole scores at L=32,768, while planning under a
#: 2 GiB limit). memsafe compiles a program it expects over the limit with autotuning off.
#: XLA's fusion autotuner, which compares its own emitters with Triton's for each fusion, is
#: another option: with it on, and the kernel autotuner off, the compile of a broadcast kNN's
#: original program (256 x 1M x 64 differences) ran past 200 s on an H100, compiling one fusion.
GPU_MEASURE_OPTIONS: dict[str, Any] = {
    "xla_gpu_autotune_level": 0,
    "xla_gpu_experimental_enable_fusion_autotuner": False,
}


#: XLA's while-loop invariant code motion moves a loop's invariant operations out of the loop,
#: where their results live through all of it. A chunk loop reads whole operands on purpose, chunk
#: by chunk: on the CPU, XLA widens bfloat16 and float16 operands to float32 and, the convert of an
#: operand being loop-invariant, hoisted the convert of the whole operand out of the loop, a float32
#: copy among the loop's temporaries (fuzz seed 181: 12 KiB over an 8 KiB budget; a 7,490 x 3
#: operand read in chunks of 7 rows took 95,080 B of temporaries with the pass, 5,160 B without).
#: memsafe compiles the programs it rewrote that hold such values without the pass. Float32
#: programs keep it: without it a kNN of 1,000 x 100,000 x 64 ran 17% slower (0.295 s against
#: 0.252 s) at the same footprint.
LOOP_OPTIONS: dict[str, Any] = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}

#: Float types XLA's CPU backend computes in float32 (it converts their operands first).
WIDENED = frozenset({np.dtype(jnp.bfloat16), np.dtype(jnp.float16)})


def loop_options(user: Mapping[str, Any] | None, dtypes: Iterable[Any]) -> dict[str, Any]:
    """The user's ``compiler_options`` for a program memsafe rewrote into loops, whose values
    have ``dtypes``: with :data:`LOOP_OPTIONS` where one of them is in :data:`WIDENED`, except
    where the user sets those options."""
    narrow = any(d in WIDENED for d in dtypes)  # no np.dtype(): PRNG key types have none
    return {**(LOOP_OPTIONS if narrow else {}), **dict(user or {})}


def contractions_stored(user: Mapping[str, Any] | None = None) -> bool:
    """Whether XLA, compiling with :func:`merged_options` of ``user`` on the default backend,
    writes every large contraction's result to a buffer of its own (what
    :func:`memsafe.graph.held.held_bytes` counts on): the CPU backend with YNNPACK fusions off,
    where a dot is a library call (measured on jax 0.10.2). Not assumed elsewhere: YNNPACK
    fuses dots with their consumers, a GPU can fuse an attention's two dots (cuDNN)."""
    if jax.default_backend() != "cpu":
        return False
    return merged_options(user).get("xla_cpu_experimental_ynn_fusion_type") == ""


def measuring_options(user: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """:func:`merged_options` for a compile whose program may exceed the limit: on a GPU with
    the autotuner off, so that compiling allocates nothing of the program's size."""
    extra = GPU_MEASURE_OPTIONS if jax.default_backend() in GPU_BACKENDS else {}
    return {**merged_options(user), **extra}


def merged_options(user: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """memsafe's options for the default backend updated with the user's ``compiler_options``;
    the user's value wins where both set an option (e.g. YNNPACK fusions back on)."""
    return {**compiler_options(), **dict(user or {})}


def memsafe_jit(
    fun: Callable[..., Any], compiler_options: Mapping[str, Any] | None = None, **kwargs: Any
) -> Any:
    """``jax.jit`` with memsafe's compiler options for the default backend, merged with
    ``compiler_options`` (see :func:`merged_options`)."""
    options = merged_options(compiler_options)
    if options:
        kwargs["compiler_options"] = options
    return jax.jit(fun, **kwargs)


@dataclass(frozen=True)
class Footprint:
    """A compiled program's memory, in bytes, from XLA's buffer assignment."""

    arguments: int
    outputs: int
    temps: int
    aliases: int
    generated_code: int = 0
    hidden_constants: int = 0

    @property
    def constants(self) -> int:
        """Folded constants (generated code) plus closed-over constants passed as hidden args."""
        return self.generated_code + self.hidden_constants

    @property
    def total(self) -> int:
        """arguments + outputs + temps - aliases + generated code + hidden constants."""
        return (
            self.arguments
            + self.outputs
            + self.temps
            - self.aliases
            + self.generated_code
            + self.hidden_constants
        )

    @classmethod
    def from_compiled(cls, compiled: Any, hidden_constants: int = 0) -> Footprint:
        stats = compiled.memory_analysis()
        if stats is None:  # some backends give no analysis
            raise RuntimeError("XLA gave no memory_analysis() for this program")
        return cls(
            arguments=int(stats.argument_size_in_bytes),
            outputs=int(stats.output_size_in_bytes),
            temps=int(stats.temp_size_in_bytes),
            aliases=int(stats.alias_size_in_bytes),
            generated_code=int(stats.generated_code_size_in_bytes),
            hidden_constants=int(hidden_constants),
        )

    def describe(self) -> str:
        return (
            f"total {format_bytes(self.total)} = arguments {format_bytes(self.arguments)}"
            f" + outputs {format_bytes(self.outputs)} + temps {format_bytes(self.temps)}"
            f" - aliases {format_bytes(self.aliases)} + constants {format_bytes(self.constants)}"
        )


def hidden_constant_bytes(consts: Sequence[Any], threshold: int = 64) -> int:
    """Bytes of closed-over array constants larger than ``threshold`` bytes."""
    total = 0
    for c in consts:
        nbytes = int(getattr(c, "nbytes", 0) or 0)
        if nbytes > threshold:
            total += nbytes
    return total
