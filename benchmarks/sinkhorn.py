"""Entropic optimal transport: memsafe on the textbook Sinkhorn loop (``examples.sinkhorn``, the
cost matrix made once outside the loop) against KeOps (a ``logsumexp`` reduction per half-step
over a symbolic cost matrix) and hand-chunked JAX (``lax.map`` over row blocks, YNNPACK on and
off), over sizes up to n = m = 50,000, d = 3, 10 iterations (where the cost matrix alone is
9.3 GiB)."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.measure import on_device, run_jax, run_memsafe, run_plain, square_cases
from examples import sinkhorn as ex

METHODS = ("jax", "memsafe", "keops", "chunked", "chunked_ynn")
EPS, STEPS = 0.05, 10
#: Largest size whose float64 reference is computed (a few seconds; it grows as n * m).
REFERENCE_MAX = 20_000


def cases(size: str) -> list[dict]:
    if size == "quick":
        sweep, limit = (2_000, 5_000, 10_000), "64MiB"
    elif size == "full":
        sweep, limit = (5_000, 10_000, 20_000, 50_000), "1GiB"
    elif size == "gpu":  # one GPU: jax.jit runs at 20k (1.6 GB of costs); 100k (40 GB) by chunks
        return [
            # the hand-chunked peer in blocks of 1024 rows (64, the CPU's best, idles a GPU)
            {"label": f"n=m={n}", "n": n, "m": n, "d": 3, "limit": "1GiB", "methods": methods}
            | {"batch": 1024}
            for n, methods in (
                (20_000, ["jax", "memsafe", "chunked"]),
                (100_000, ["memsafe", "chunked"]),
            )
        ]
    else:
        raise ValueError(f"unknown size {size!r}; expected 'quick', 'full' or 'gpu'")
    return square_cases(sweep, limit, METHODS)


def gemm_flops(params: dict) -> tuple[float, str]:
    """The cost matrix's cross term, made twice per iteration (2nmd each), float32. The
    exponentials, not the products, bound this workload at d=3."""
    return 4.0 * STEPS * params["n"] * params["m"] * params["d"], "float32"


def run_case(method: str, params: dict) -> dict[str, Any]:
    x, y = ex.make_inputs(params["n"], params["m"], params["d"])
    if method == "jax":
        out, info = run_jax(lambda x, y: ex.sinkhorn(x, y, EPS, STEPS), on_device(x, y), params)
    elif method == "memsafe":
        out, info = run_memsafe(lambda x, y: ex.sinkhorn(x, y, EPS, STEPS), on_device(x, y), params)
    elif method == "keops":
        from benchmarks.peers import keops

        out, info = run_plain(lambda: keops.sinkhorn(x, y, EPS, STEPS), params)
    elif method in ("chunked", "chunked_ynn"):
        from benchmarks.peers import chunked_jax

        # the fastest of 64, 256, 1024 and 2048 rows at n = m = 10,000, YNNPACK off (1.6 s)
        # and on (3.8-4.3 s, at 2048 rows)
        ynn = method == "chunked_ynn"
        batch = params.get("batch", 2048 if ynn else 64)
        fun = chunked_jax.jit(chunked_jax.sinkhorn, ynn=ynn, static_argnums=(2, 3, 4))
        args = on_device(x, y)
        out, info = run_plain(lambda: fun(*args, EPS, STEPS, batch), params)
        info["batch"] = batch
    else:
        raise ValueError(f"sinkhorn: unknown method {method!r}")
    if out is not None:
        f, g = (np.asarray(v) for v in out)
        info["accuracy"] = {"dual_cost": float(f.mean() + g.mean())}
        if params["n"] <= REFERENCE_MAX:
            want = ex.reference(x, y, EPS, STEPS)
            info["accuracy"]["max_abs_potential_error"] = ex.max_error((f, g), want)
    return info
