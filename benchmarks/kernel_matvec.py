"""Gaussian-kernel matrix-vector product: memsafe on ``exp(-sqdist / (2 l^2)) @ v`` against
KeOps and ``lax.map(batch_size=256)`` (YNNPACK on and off), over a sweep of sizes up to
n = m = 100,000, d = 3 (where ``K @ v`` needs a 37 GiB kernel matrix)."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.measure import on_device, run_jax, run_memsafe, run_plain, square_cases
from examples import kernel_matvec as ex

METHODS = ("jax", "memsafe", "keops", "chunked", "chunked_ynn")
LENGTHSCALE = 0.5


def cases(size: str) -> list[dict]:
    if size == "quick":
        sweep, limit = (2_000, 5_000, 10_000, 20_000), "64MiB"
    elif size == "full":
        sweep, limit = (5_000, 10_000, 20_000, 50_000, 100_000), "1GiB"
    elif size == "gpu":  # one GPU: jax.jit fits up to 100k; 1M is memsafe and by hand only
        return [
            {"label": f"n=m={n}", "n": n, "m": n, "d": 3, "limit": "1GiB", "methods": methods}
            for n, methods in (
                (20_000, ["jax", "memsafe", "chunked"]),
                (100_000, ["jax", "memsafe", "chunked"]),
                (1_000_000, ["memsafe", "chunked"]),
            )
        ]
    else:
        raise ValueError(f"unknown size {size!r}; expected 'quick', 'full' or 'gpu'")
    return square_cases(sweep, limit, METHODS)


def gemm_flops(params: dict) -> tuple[float, str]:
    """The products: the cross term of the distances (2nmd) and the matvec (2nm), float32."""
    return 2.0 * params["n"] * params["m"] * (params["d"] + 1), "float32"


def run_case(method: str, params: dict) -> dict[str, Any]:
    x, y, v = ex.make_inputs(params["n"], params["m"], params["d"])
    ls = np.float32(LENGTHSCALE)
    args = on_device(x, y, v, ls)
    if method == "jax":
        out, info = run_jax(ex.gaussian_kernel_matvec, args, params)
    elif method == "memsafe":
        out, info = run_memsafe(ex.gaussian_kernel_matvec, args, params)
    elif method == "keops":
        from benchmarks.peers import keops

        out, info = run_plain(lambda: keops.gaussian_kernel_matvec(x, y, v, LENGTHSCALE), params)
    elif method in ("chunked", "chunked_ynn"):
        from benchmarks.peers import chunked_jax

        batch = params.get("batch", 256)
        fun = chunked_jax.jit(
            chunked_jax.gaussian_kernel_matvec, ynn=method == "chunked_ynn", static_argnums=4
        )
        out, info = run_plain(lambda: fun(*args, batch), params)
        info["batch"] = batch
    else:
        raise ValueError(f"kernel_matvec: unknown method {method!r}")
    if out is not None:
        rows = np.random.default_rng(1).choice(
            params["n"], size=min(200, params["n"]), replace=False
        )
        ref = ex.reference(x, y, v, LENGTHSCALE, rows)
        info["accuracy"] = {"relative_error": ex.relative_error(np.asarray(out)[rows], ref)}
    return info
