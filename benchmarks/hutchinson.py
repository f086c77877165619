"""The Hutchinson trace estimator of seeds 000/001 (tiled context, nested vmap): memsafe's
footprint against jax.jit's, and the same estimates for the same keys. memsafe runs at jax.jit's
own footprint (where it must not grow) and at half of it (where it must rewrite the tiling)."""

from __future__ import annotations

from typing import Any

import numpy as np

from benchmarks.measure import footprint_dict, run_jax, run_memsafe
from examples import hutchinson as ex

METHODS = ("jax", "memsafe_same", "memsafe_half")


def cases(size: str) -> list[dict]:
    if size == "quick":
        b, n, dc = 16, 250, 128
    elif size in ("full", "gpu"):
        b, n, dc = 64, 1000, 512
    else:
        raise ValueError(f"unknown size {size!r}; expected 'quick' or 'full'")
    return [
        {
            "label": f"B={b} N={n} Dc={dc}",
            "B": b,
            "N": n,
            "D": 2,
            "Dc": dc,
            "methods": list(METHODS),
        }
    ]


def run_case(method: str, params: dict) -> dict[str, Any]:
    import jax

    inputs = ex.make_inputs(params["B"], params["N"], params["D"], params["Dc"])
    if method == "jax":
        out, info = run_jax(ex.traces_tiled, inputs, params)
    else:
        need = footprint_dict(jax.jit(ex.traces_tiled).lower(*inputs).compile())["total"]
        limit = need if method == "memsafe_same" else need // 2
        out, info = run_memsafe(ex.traces_tiled, inputs, {**params, "limit": limit})
        info["jax_footprint"] = need
    if out is not None:
        ref = np.asarray(jax.jit(ex.traces_broadcast)(*inputs))
        info["accuracy"] = {"max_abs_difference": float(np.max(np.abs(np.asarray(out) - ref)))}
        info["mean_estimate"] = float(np.mean(np.asarray(out)))
    return info
