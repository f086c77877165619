"""memsafe on one GPU: the checks of tests/mesh_checks.py with a mesh of the one device, each in its
own process so that the device's measured peak memory is the check's own.

    python -m tools.gpu_checks --out benchmarks/results/gpu/checks.json   # every check
    python -m tools.gpu_checks knn attention                              # some, printed
    python -m tools.gpu_checks --untuned --timeout 300 knn                # autotuner off
    python -m tools.gpu_checks --verbose knn                              # with memsafe's log

Each check compares memsafe's answer with plain jax.jit's on the same GPU (or a float64 reference
where jax.jit does not fit), asserts the compiled per-device footprint is under the limit, and
records the allocator's peak bytes in use (``memory_stats()['peak_bytes_in_use']``), the
measured counterpart of the footprint. The CPU tests run the same programs on 8 host devices.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

MiB = 2**20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _setup() -> None:
    """JAX on the GPU, allocating as it goes (the peak is then what the program used)."""
    os.environ.setdefault("JAX_PLATFORMS", "cuda")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    sys.path.insert(0, ROOT)


def _peak() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}  # None on the CPU
    return stats.get("peak_bytes_in_use")


#: Set (by ``--untuned``) for every check's process: XLA's GPU autotuner off in every compile.
UNTUNED = "MEMSAFE_GPU_CHECKS_UNTUNED"
#: Set (by ``--verbose``) for every check's process: memsafe's log at INFO (each compile attempt
#: and its seconds), kept in the check's result.
VERBOSE = "MEMSAFE_GPU_CHECKS_VERBOSE"


def _options() -> dict[str, Any]:
    """memsafe's compiler options for the checks: the autotuner off where ``--untuned`` asked
    (planning then allocates nothing beside the footprint; kernels run untuned)."""
    return {"xla_gpu_autotune_level": 0} if os.environ.get(UNTUNED) else {}


def _safe(fun: Callable, limit: int) -> Any:
    """``memsafe.jit`` of ``fun`` under ``limit`` on the one-device mesh, with the checks'
    compiler options."""
    import memsafe

    return memsafe.jit(fun, memory_limit=limit, mesh=_mesh(), compiler_options=_options())


def _mesh():
    import jax
    import numpy as np
    from jax.sharding import Mesh

    return Mesh(np.array(jax.devices()[:1]), ("d",))


def _refusal(fun: Callable, limit: int, *args) -> str:
    """The first line of the MemoryLimitError memsafe raises for ``fun`` on the one-device mesh."""
    import memsafe

    try:
        _safe(fun, limit)(*args)
    except memsafe.MemoryLimitError as err:
        return str(err).splitlines()[0]
    raise AssertionError(f"expected a MemoryLimitError at {limit} bytes")


def _jit_footprint(fun: Callable, *args) -> int:
    """Plain jax.jit's compiled footprint of ``fun`` (memory_analysis)."""
    import jax

    from memsafe.xla import Footprint

    return Footprint.from_compiled(jax.jit(fun).lower(*args).compile()).total


def _relative(a, b) -> float:
    """max |a - b| / max |b|."""
    import numpy as np

    a, b = np.asarray(a), np.asarray(b)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def _timed(fun: Callable, *args) -> tuple[Any, dict]:
    """The result and {first_s (planning and compiling included), call_s (a second call),
    memsafe_peak_bytes (the device's peak so far: before any reference runs)}."""
    import jax

    start = time.perf_counter()
    out = jax.block_until_ready(fun(*args))
    first = time.perf_counter() - start
    start = time.perf_counter()
    jax.block_until_ready(fun(*args))
    again = time.perf_counter() - start
    return out, {"first_s": first, "call_s": again, "memsafe_peak_bytes": _peak()}


def _knn_reference(x, y, k: int, rows: int = 65536):
    """The k nearest by float64 distances (expanded: |x|^2 - 2 x.y + |y|^2, exact enough for
    random data), lowest index first among equal distances: each database block's k best, then
    the best k of those."""
    import numpy as np

    x64 = np.asarray(x, np.float64)
    dists, idxs = [], []
    for start in range(0, len(y), rows):
        part = np.asarray(y[start : start + rows], np.float64)
        d = (x64**2).sum(1)[:, None] - 2 * x64 @ part.T + (part**2).sum(1)[None]
        best = np.argsort(d, axis=1, kind="stable")[:, :k]
        dists.append(np.take_along_axis(d, best, 1))
        idxs.append(best + start)
    d, i = np.concatenate(dists, 1), np.concatenate(idxs, 1)
    order = np.lexsort((i, d), axis=1)
    return np.take_along_axis(i, order, 1)[:, :k]


def check_knn() -> dict:
    """kNN, 1M x 64 database (256 MiB): refused at 96 MiB on the one device (its database alone
    exceeds it), run at 512 MiB: the neighbours equal a float64 reference's."""
    import numpy as np

    from tests import mesh_checks as mc

    x, y = mc.knn_data(256, 1 << 20)
    refusal = _refusal(mc.knn, 96 * MiB, x, y)
    limit = 512 * MiB
    f = _safe(mc.knn, limit)
    (_, idx), timing = _timed(f, x, y)
    np.testing.assert_array_equal(np.asarray(idx), _knn_reference(x, y, mc.K))
    footprint = f.plan(x, y).after.total
    assert footprint <= limit, footprint
    return {"limit": limit, "footprint": footprint, "refusal_at_96MiB": refusal,
            **timing, "plan": str(f.plan(x, y))}  # fmt: skip


def check_attention() -> dict:
    """Attention with the keys split (online softmax), forward and gradient, against jax.jit."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from tests import mesh_checks as mc

    rng = np.random.default_rng(3)
    h, length, d = 8, 8192, 64
    q, k, v = (rng.standard_normal((h, length, d)).astype(np.float32) for _ in range(3))
    limit = 256 * MiB
    f = _safe(mc.attention, limit)
    got, timing = _timed(f, q, k, v)
    want = jax.jit(mc.attention)(q, k, v)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-4)

    def loss(fun):
        return lambda q, k, v: jnp.sum(fun(q, k, v) ** 2)

    grads = jax.grad(loss(f), argnums=(0, 1, 2))(q, k, v)
    ref = jax.jit(jax.grad(loss(mc.attention), argnums=(0, 1, 2)))(q, k, v)
    errors = [_relative(a, b) for a, b in zip(grads, ref)]
    assert max(errors) < 1e-2, errors
    footprint, backward = f.plan(q, k, v).after.total, f.backward_plan(q, k, v).after.total
    assert max(footprint, backward) <= limit, (footprint, backward)
    return {"limit": limit, "footprint": footprint, "backward_footprint": backward,
            **timing, "grad_relative_errors": errors,
            "jax_jit_footprint": _jit_footprint(mc.attention, q, k, v)}  # fmt: skip


def check_sgpr() -> dict:
    """The SGPR bound and its gradient (float64) with the data points split, against jax.jit."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from examples import sgpr

    with jax.enable_x64(True):
        x, y, z = sgpr.make_data(200_000, 500, 3, 0)
        params = {"variance": jnp.asarray(1.3), "lengthscales": jnp.full(3, 0.7),
                  "noise": jnp.asarray(0.2), "Z": jnp.asarray(z)}  # fmt: skip
        limit = 256 * MiB
        f = _safe(sgpr.sgpr_elbo, limit)
        got, timing = _timed(f, params, x, y)
        want = jax.jit(sgpr.sgpr_elbo)(params, x, y)
        np.testing.assert_allclose(got, want, rtol=1e-9)
        grads = jax.grad(f)(params, x, y)
        ref = jax.jit(jax.grad(sgpr.sgpr_elbo))(params, x, y)
        errors = {key: _relative(grads[key], ref[key]) for key in params}
        assert max(errors.values()) < 1e-6, errors  # Kuu's conditioning amplifies rounding
        plan = f.plan(params, x, y)
        assert plan.after.total <= limit and plan.backward.after.total <= limit, plan
    return {"limit": limit, "footprint": plan.after.total, **timing,
            "backward_footprint": plan.backward.after.total, "grad_relative_errors": errors,
            "jax_jit_footprint": plan.before.total}  # fmt: skip


def check_train_step() -> dict:
    """A data-parallel MLP step (the batch split into micro-batches), against jax.jit."""
    import jax
    import numpy as np

    from tests import mesh_checks as mc

    params, x, y = mc.mlp_data(65536)
    limit = 32 * MiB
    step = _safe(mc.sgd_step, limit)
    got, timing = _timed(step, params, x, y)
    want = jax.jit(mc.sgd_step)(params, x, y)
    for key in params:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, atol=1e-6)
    plan = step.plan(params, x, y)
    assert plan.after.total <= limit < plan.before.total, plan
    return {"limit": limit, "footprint": plan.after.total, "jax_jit_footprint": plan.before.total,
            **timing, "micro_batches": plan.splits[0].loops}  # fmt: skip


CHECKS: dict[str, Callable[[], dict]] = {
    "train_step": check_train_step,
    "attention": check_attention,
    "sgpr": check_sgpr,
    "knn": check_knn,
}


def run_one(name: str) -> dict:
    """One check in this process: its numbers, the device and the measured peak."""
    _setup()
    import jax

    if os.environ.get(VERBOSE):
        import memsafe

        memsafe.set_verbosity("info")
    result = {"check": name, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
              "compiler_options": _options()}  # fmt: skip
    start = time.perf_counter()
    result.update(CHECKS[name]())
    result.update(status="ok", wall_s=time.perf_counter() - start, device_peak_bytes=_peak())
    return result


def _run_child(name: str, timeout: float | None) -> dict:
    """One check in its own process: its result, or why it has none (failed, timed out)."""
    cmd = [sys.executable, "-m", "tools.gpu_checks", "--one", name]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, check=False, timeout=timeout
        )
    except subprocess.TimeoutExpired as err:
        tail = (err.stderr or b"")[-3000:]
        tail = tail.decode(errors="replace") if isinstance(tail, bytes) else tail
        return {"check": name, "status": "timeout", "timeout_s": timeout, "stderr": tail}
    if proc.returncode == 0:
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if os.environ.get(VERBOSE):
            result["log"] = proc.stderr[-3000:]
        return result
    return {"check": name, "status": "failed", "stderr": proc.stderr[-3000:]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checks", nargs="*", default=list(CHECKS), help=f"of {list(CHECKS)}")
    parser.add_argument("--out", help="a JSON file for every check's result")
    parser.add_argument("--timeout", type=float, default=None, help="seconds per check")
    parser.add_argument("--untuned", action="store_true", help="XLA's GPU autotuner off")
    parser.add_argument("--verbose", action="store_true", help="memsafe's log in each result")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one check
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(args.one)))
        return 0
    if args.untuned:
        os.environ[UNTUNED] = "1"  # read by each check's process
    if args.verbose:
        os.environ[VERBOSE] = "1"
    results, failed = [], 0
    for name in args.checks:
        res = _run_child(name, args.timeout)
        failed += res["status"] != "ok"
        results.append(res)
        print(json.dumps({k: v for k, v in res.items() if k != "plan"}), flush=True)
        if args.out:  # after each check: a run cut short keeps what it measured
            with open(args.out, "w") as fh:
                json.dump(results, fh, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
