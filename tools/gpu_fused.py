"""Issue 43's side-by-side run, in one process: memsafe's fused kernels (memsafe.fused) against
memsafe's chunk loops and the fused kernels users would otherwise pick, on the same device.

    python -m tools.gpu_fused --out $OUT/fused.json            # on the GPU (about 4 minutes)
    python -m tools.gpu_fused --small --out /tmp/fused.json    # a dry run of every step (CPU)

Workloads (``--small`` shrinks each): attention forward and forward+backward at L=32,768, 8
heads, d=64 under 2 GiB, in float32 and bfloat16 (cuDNN runs half precision only); the Gaussian
kernel matvec at n=m=1M, d=3 under 1 GiB, with the exponential-throughput bound measured in the
same run (1e12 exponentials at the rate of an ``exp`` fused into a sum over an iota: no memory
traffic); kNN L2 10k x 1M x 64, k=10 under 1 GiB. Peers: memsafe fused and chunked, jax.nn's
``dot_product_attention`` (implementation cudnn and xla), JAX's Pallas attention
(``jax.experimental.pallas.ops.gpu.attention.mha``), hand-chunked JAX (benchmarks.peers),
jax.jit where it fits, KeOps where ``pykeops`` imports and compiles (the device has no network:
its wheel, ``keopscore``'s, and a CUDA toolkit with nvcc/nvrtc headers must be carried).

Every method runs in its own try/except; its error is recorded and the next one runs. The JSON
is rewritten after every measurement, so a run cut short by its time limit leaves what it got.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass
class Run:
    """The results so far, written to ``out`` after each measurement."""

    out: str
    budget_s: float
    repeats: int
    started: float = dataclasses.field(default_factory=time.perf_counter)
    results: dict[str, Any] = dataclasses.field(default_factory=dict)
    deadline: float = float("inf")  # of the workload running now (:meth:`share`)

    def share(self, part: float) -> None:
        """The workload starting now may run until ``part`` of the whole budget is spent."""
        self.deadline = self.started + part * self.budget_s

    def left(self) -> float:
        return self.deadline - time.perf_counter()

    def record(self, workload: str, method: str, info: dict[str, Any]) -> None:
        self.results.setdefault(workload, {})[method] = info
        print(f"{workload:>28} {method:<22} {_short(info)}", flush=True)
        with open(self.out, "w") as fh:
            json.dump(self.results, fh, indent=1, default=str)

    def measure(self, workload: str, method: str, make: Callable[[], Callable[[], Any]]) -> Any:
        """Build ``make()`` (planning, compiling) and time the call it returns; the error where
        any step raises. Skipped when the run's budget is spent."""
        if self.left() < 5:
            self.record(workload, method, {"skipped": "time budget spent"})
            return None
        info: dict[str, Any] = {}
        try:
            start = time.perf_counter()
            call = make()
            out = _block(call())
            info["first_s"] = time.perf_counter() - start
            from benchmarks.measure import WARM_UP_CALLS

            for _ in range(WARM_UP_CALLS - 1):
                out = _block(call())
            times = []
            while len(times) < self.repeats and self.left() > 5:
                start = time.perf_counter()
                out = _block(call())
                times.append(time.perf_counter() - start)
            info.update(times_s=times, min_s=min(times) if times else None)
            info.update(_extra(call))
            info["device_peak"] = _peak()
        except Exception as err:  # a peer that does not run here: recorded, the next one runs
            info["error"] = f"{type(err).__name__}: {err}"[:2000]
            info["trace"] = traceback.format_exc()[-3000:]
            out = None
        self.record(workload, method, info)
        return out


def _short(info: dict[str, Any]) -> str:
    if "error" in info:
        return "error: " + info["error"][:160].replace("\n", " ")
    keys = ("min_s", "first_s", "fused", "footprint_total", "max_abs_error", "relative_error")
    return " ".join(f"{k}={info[k]}" for k in keys if k in info) or str(info)[:160]


def _block(x: Any) -> Any:
    import jax

    return jax.block_until_ready(x)


def _peak() -> int | None:
    import jax

    if jax.default_backend() == "cpu":
        return None
    return (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")


def _extra(call: Callable[[], Any]) -> dict[str, Any]:
    """What a memsafe call's plan says (whether a fused kernel ran, the footprint)."""
    plan = getattr(call, "plan", None)
    if plan is None:
        return {}
    from memsafe.plan import SplitRecord

    splits = [r for r in plan.records if isinstance(r, SplitRecord)]
    fp = plan.attempts[-1].footprint if plan.attempts else None
    return {
        "fused": [s for r in splits for s in r.sinks if s.startswith("fused[")],
        "splits": [f"{r.value} axis {r.axis} chunk {r.chunk} sinks {r.sinks}" for r in splits],
        "footprint_total": None if fp is None else fp.total,
        "limit": plan.memory_limit,
    }


def _memsafe(fun: Callable, args: tuple, limit: str, fused: bool) -> Callable[[], Any]:
    """memsafe.jit of ``fun`` under ``limit``, fused kernels on or off (the policy stays so
    until the next call of this function); the call carries the plan (``.plan``)."""
    import memsafe
    from memsafe.fused import policy

    policy.FUSED = dataclasses.replace(policy.FUSED, enabled=fused)
    safe = memsafe.jit(fun, memory_limit=limit)
    _block(safe(*args))  # plans now, under this policy
    plan = safe.plan(*args)

    def call() -> Any:
        return safe(*args)

    call.plan = plan  # type: ignore[attr-defined]
    return call


# -- attention -----------------------------------------------------------------------------------


def _bthd(fun: Callable) -> Callable:
    """``fun`` of (batch, L, heads, d) arrays as a function of (heads, L, d) ones."""

    def of_hld(q: Any, k: Any, v: Any) -> Any:
        out = fun(*(a.transpose(1, 0, 2)[None] for a in (q, k, v)))
        return out[0].transpose(1, 0, 2)

    return of_hld


def _peers(scale: float, interpret: bool) -> dict[str, Callable]:
    """JAX's fused attentions, each of (heads, L, d) arrays."""
    import jax

    def cudnn(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn")

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="xla")

    def pallas(q, k, v):
        from jax.experimental.pallas.ops.gpu import attention as pa

        return pa.mha(q, k, v, segment_ids=None, sm_scale=scale, interpret=interpret)

    return {
        "cudnn": _bthd(cudnn),
        "xla_dot_product_attention": _bthd(xla),
        "pallas_mha": _bthd(pallas),
    }


def _loss_of(att: Callable) -> Callable:
    import jax
    import jax.numpy as jnp

    def loss(q: Any, k: Any, v: Any) -> Any:
        return 0.5 * jnp.sum(att(q, k, v).astype(jnp.float32) ** 2)

    return jax.value_and_grad(loss, argnums=(0, 1, 2))


def attention(run: Run, length: int, heads: int, d: int, limit: str, small: bool) -> None:
    """Forward and forward+backward, float32 and bfloat16, every method."""
    from examples import attention as ex

    q0, k0, v0 = ex.make_inputs(heads, length, d)
    for dtype in ("bfloat16", "float32"):  # cuDNN runs half precision only: bfloat16 first
        _attention_in(run, (q0, k0, v0), dtype, limit, small)


def _attention_in(run: Run, qkv: tuple, dtype: str, limit: str, small: bool) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from benchmarks.peers import chunked_attention as ca
    from examples import attention as ex

    q, k, v = (jax.device_put(jnp.asarray(a, dtype)) for a in qkv)
    length, d = q.shape[1], q.shape[2]
    rows = np.random.default_rng(1).choice(length, size=32, replace=False)
    ref = ex.reference(*qkv, False, rows)
    peers = _peers(1.0 / math.sqrt(d), small)
    chunks = {"query_chunk": min(1024, length), "key_chunk": min(4096, length)}
    args = (q, k, v)
    forward: dict[str, Callable[[], Callable[[], Any]]] = {
        "memsafe_fused": lambda: _memsafe(ex.attention, args, limit, True),
        "memsafe_chunked": lambda: _memsafe(ex.attention, args, limit, False),
        **{n: functools.partial(_jitted, f, args) for n, f in peers.items()},
        "hand_chunked": functools.partial(_jitted, functools.partial(ca.attention, **chunks), args),
        "jax_jit": functools.partial(_jitted, ex.attention, args),
    }
    for method, make in forward.items():
        out = run.measure(f"attention_fwd_{dtype}", method, make)
        if out is not None:
            err = float(np.max(np.abs(np.asarray(out, np.float32)[:, rows] - ref)))
            run.results[f"attention_fwd_{dtype}"][method]["max_abs_error"] = err
    grad = ex.attention_value_and_grad
    backward: dict[str, Callable[[], Callable[[], Any]]] = {
        "memsafe_fused": lambda: _memsafe(grad, args, limit, True),
        "memsafe_chunked": lambda: _memsafe(grad, args, limit, False),
        **{n: functools.partial(_jitted, _loss_of(f), args) for n, f in peers.items()},
        "hand_chunked": functools.partial(
            _jitted, functools.partial(ca.attention_value_and_grad, **chunks), args
        ),
        "jax_jit": functools.partial(_jitted, grad, args),
    }
    for method, make in backward.items():
        out = run.measure(f"attention_fwd_bwd_{dtype}", method, make)
        if out is not None:
            loss, grads = out
            run.results[f"attention_fwd_bwd_{dtype}"][method].update(
                loss=float(loss),
                grad_norms=[float(np.linalg.norm(np.asarray(g, np.float32))) for g in grads],
            )


def _jitted(fun: Callable, args: tuple) -> Callable[[], Any]:
    """jax.jit of ``fun``, called on ``args``."""
    import jax

    return functools.partial(jax.jit(fun), *args)


# -- Gaussian kernel matvec ----------------------------------------------------------------------


def exp_bound(run: Run, count: float, small: bool) -> None:
    """Seconds for ``count`` float32 exponentials at the rate of one XLA fusion that makes its
    operands from an iota and sums the exponentials (nothing read from or written to memory but
    the sum)."""
    import jax
    import jax.numpy as jnp
    from jax import lax

    n = 2**20 if small else 2**30

    @jax.jit
    def exps(c):
        x = lax.iota(jnp.float32, n) * c
        return jnp.sum(jnp.exp(-x))

    c = jnp.float32(1e-9)
    out = run.measure("kernel_matvec", "exp_rate", lambda: functools.partial(exps, c))
    if out is not None:
        info = run.results["kernel_matvec"]["exp_rate"]
        if info.get("min_s"):
            info["exp_per_s"] = n / info["min_s"]
            info["bound_s"] = count * info["min_s"] / n
            info["note"] = f"{count:.3g} exponentials at the rate of {n} in one fusion"


def kernel_matvec(run: Run, n: int, m: int, d: int, limit: str, small: bool) -> None:
    import jax
    import numpy as np

    from benchmarks.peers import chunked_jax, keops
    from examples import kernel_matvec as ex

    ls = 0.1
    x, y, v = ex.make_inputs(n, m, d)
    args = tuple(jax.device_put(a) for a in (x, y, v, np.float32(ls)))
    rows = np.random.default_rng(1).choice(n, size=min(200, n), replace=False)
    ref = ex.reference(x, y, v, ls, rows)
    exp_bound(run, float(n) * m, small)
    chunked = chunked_jax.jit(chunked_jax.gaussian_kernel_matvec, ynn=False, static_argnums=4)
    methods = {
        "memsafe_fused": lambda: _memsafe(ex.gaussian_kernel_matvec, args, limit, True),
        "memsafe_chunked": lambda: _memsafe(ex.gaussian_kernel_matvec, args, limit, False),
        "hand_chunked": lambda: functools.partial(chunked, *args, 256),
        "keops": lambda: functools.partial(keops.gaussian_kernel_matvec, x, y, v, ls),
        "jax_jit": lambda: functools.partial(jax.jit(ex.gaussian_kernel_matvec), *args),
    }
    for method, make in methods.items():
        if method == "jax_jit" and not small:
            run.record("kernel_matvec", method, {"skipped": "the n x m kernel: 4 TB"})
            continue
        out = run.measure("kernel_matvec", method, make)
        if out is not None:
            rel = ex.relative_error(np.asarray(out)[rows], ref)
            run.results["kernel_matvec"][method]["relative_error"] = rel


# -- kNN -----------------------------------------------------------------------------------------


def knn(run: Run, n: int, m: int, d: int, k: int, limit: str) -> None:
    import jax
    import numpy as np

    from benchmarks.peers import keops
    from examples import knn as ex

    x = np.random.default_rng(0).standard_normal((n, d)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal((m, d)).astype(np.float32)
    args = (jax.device_put(x), jax.device_put(y))
    fun = functools.partial(ex.knn_l2_expanded, k=k)
    methods = {
        "memsafe_fused": lambda: _memsafe(fun, args, limit, True),
        "memsafe_chunked": lambda: _memsafe(fun, args, limit, False),
        "keops": lambda: functools.partial(keops.knn, x, y, k),
    }
    found = {}
    for method, make in methods.items():
        out = run.measure("knn", method, make)
        if out is not None:
            found[method] = np.asarray(out[1])
    if found:
        base = found.get("memsafe_chunked", next(iter(found.values())))
        for method, idx in found.items():
            same = np.mean([len(set(a) & set(b)) / k for a, b in zip(idx, base)])
            run.results["knn"][method]["agreement_with_memsafe_chunked"] = float(same)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/gpu-out/fused.json")
    parser.add_argument("--small", action="store_true", help="tiny sizes: a dry run (CPU)")
    parser.add_argument("--budget", type=float, default=225.0, help="seconds for everything")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="attention,kernel_matvec,knn")
    a = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    import jax

    if a.small:  # the CPU: Pallas in interpret mode, small tiles
        from memsafe.fused import policy

        policy.FUSED = policy.FusedPolicy(interpret=True, rows=16, cols=32)
    run = Run(a.out, a.budget, a.repeats)
    run.results["environment"] = {
        "jax": jax.__version__,
        "devices": [str(dv) for dv in jax.devices()],
        "device_kind": jax.devices()[0].device_kind,
        "load": os.getloadavg(),
    }
    only = set(a.only.split(","))
    run.share(0.55)
    if "attention" in only:
        length, limit = (256, "400KiB") if a.small else (32_768, "2GiB")
        attention(run, length, 8 if not a.small else 2, 64 if not a.small else 16, limit, a.small)
    run.share(0.8)
    if "kernel_matvec" in only:
        n, limit = (2000, "4MiB") if a.small else (1_000_000, "1GiB")
        kernel_matvec(run, n, n, 3, limit, a.small)
    run.share(1.0)
    if "knn" in only:
        n, m, limit = (100, 4000, "1MiB") if a.small else (10_000, 1_000_000, "1GiB")
        knn(run, n, m, 64 if not a.small else 16, 10, limit)
    run.results["elapsed_s"] = time.perf_counter() - run.started
    with open(a.out, "w") as fh:
        json.dump(run.results, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
