"""The machine's GEMM rate, measured in each run: the bound product-bound times are read against.

``jax.jit(a @ b)`` of square matrices (2048 on the CPU, 8192 on a GPU), the best of a few calls
after a warm-up, as FLOP/s per dtype and matmul precision. The runner measures it once per run
(``benchmarks.run``) and reports each kNN, kernel-sum, attention and SGPR time also as a multiple
of its GEMM bound: the flops of the products the program must do (``gemm_flops`` of each
workload) at this rate.
"""

from __future__ import annotations

import time
from typing import Any

#: Square size per backend: big enough to reach the machine's rate, small enough to take seconds.
SIZES = {"cpu": 2048}
GPU_SIZE = 8192


def cases(size: str) -> list[dict]:
    """One case per (dtype, precision); the size of the product is the backend's."""
    del size  # the GEMM bound is a property of the machine, measured the same in every run
    rows = [("float32", "default"), ("float32", "highest"), ("float64", "default")]
    return [{"label": f"{d} {p}", "dtype": d, "precision": p, "methods": ["jax"]} for d, p in rows]


def run_case(method: str, params: dict) -> dict[str, Any]:
    """``params``: dtype, precision. Returns the rate (FLOP/s) and the times."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    del method
    backend = jax.default_backend()
    n = SIZES.get(backend, GPU_SIZE)
    precision = None if params["precision"] == "default" else params["precision"]
    with jax.enable_x64(params["dtype"] == "float64"):
        rng = np.random.default_rng(0)
        a, b = (jnp.asarray(rng.standard_normal((n, n)), params["dtype"]) for _ in range(2))
        fun = jax.jit(lambda a, b: jnp.matmul(a, b, precision=precision))
        jax.block_until_ready(fun(a, b))
        times = []
        for _ in range(5):
            start = time.perf_counter()
            jax.block_until_ready(fun(a, b))
            times.append(time.perf_counter() - start)
    best = min(times)
    return {"n": n, "min_s": best, "times_s": times, "rate_flops": 2 * n**3 / best}


def measure(run_method) -> dict[str, float]:
    """Each case's rate, keyed by label ('float32 default', ...), run by ``run_method(workload,
    method, params)`` (the runner's subprocess); a case that failed is left out."""
    rates = {}
    for case in cases(""):
        params = {k: v for k, v in case.items() if k != "methods"}
        res = run_method("gemm", "jax", params)
        if "rate_flops" in res:
            rates[case["label"]] = res["rate_flops"]
    return rates


def bound_seconds(flops: float, dtype: str, rates: dict[str, float]) -> float | None:
    """Seconds ``flops`` of products take at this machine's rate for ``dtype`` (default
    precision), or None if the rate was not measured."""
    rate = rates.get(f"{dtype} default")
    return None if not rate else flops / rate
