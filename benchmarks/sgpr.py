"""SGPR: the collapsed bound and its gradient under memsafe.jit, plain jax.jit and GPflow 2.11.2
(in its own environment, see ``benchmarks.gpflow_env``), float64.

Scale: data shaped like UCI 3droad (N=434,874, D=3, synthetic), M=2,000, under 4 GiB, where
Kuf and A alone are 7 GB each. Speed where all fit: gradient at N=200k, M=500 and bound at
N=200k, M=1,000.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.measure import run_jax, run_memsafe
from examples import sgpr as ex


def _case(label: str, what: str, n: int, m: int, limit: str, methods) -> dict:
    return {
        "label": label,
        "what": what,
        "n": n,
        "m": m,
        "d": 3,
        "limit": limit,
        "methods": list(methods),
        "reference": "gpflow" if "gpflow" in methods else "jax",
    }


def cases(size: str) -> list[dict]:
    """The cases of ``size``; ``SGPR_CASES`` (comma-separated labels) keeps a subset, e.g. the
    speed cases without the minutes-long 3droad ones."""
    every = _cases(size)
    keep = [c for c in os.environ.get("SGPR_CASES", "").split(",") if c]
    return [c for c in every if c["label"] in keep] if keep else every


def _cases(size: str) -> list[dict]:
    both = ("jax", "memsafe", "gpflow")
    if size == "quick":
        return [
            _case("grad N=20k M=200", "grad", 20_000, 200, "1GiB", both),
            _case("bound N=20k M=300", "bound", 20_000, 300, "1GiB", both),
            _case("scale grad N=50k M=500", "grad", 50_000, 500, "128MiB", ("jax", "memsafe")),
            _case("scale bound N=50k M=500", "bound", 50_000, 500, "128MiB", ("jax", "memsafe")),
        ]
    if size == "full":
        return [
            _case("grad N=200k M=500", "grad", 200_000, 500, "4GiB", both),
            _case("bound N=200k M=1000", "bound", 200_000, 1000, "4GiB", both),
            _case("3droad bound M=2000", "bound", 434_874, 2000, "4GiB", ("jax", "memsafe")),
            _case("3droad grad M=2000", "grad", 434_874, 2000, "4GiB", ("jax", "memsafe")),
        ]
    if size == "gpu":
        # The eXLA paper's scale: M=10,000 inducing points on 3droad, where one Kuf alone is
        # 34.8 GB in float64, under 16 GiB; and M=2,000, where plain jax.jit fits the GPU.
        return [
            _case("3droad bound M=2000", "bound", 434_874, 2000, "16GiB", ("jax", "memsafe")),
            _case("3droad grad M=2000", "grad", 434_874, 2000, "16GiB", ("jax", "memsafe")),
            _case("3droad bound M=10000", "bound", 434_874, 10_000, "16GiB", ("jax", "memsafe")),
            _case("3droad grad M=10000", "grad", 434_874, 10_000, "16GiB", ("jax", "memsafe")),
        ]
    raise ValueError(f"unknown size {size!r}; expected 'quick', 'full' or 'gpu'")


def gemm_flops(params: dict) -> tuple[float, str]:
    """The bound's products: the triangular solve A = L^-1 Kuf (M^2 N) and A A^T (2 M^2 N); its
    gradient, three times the bound's (reverse mode's usual ratio), float64."""
    flops = 3.0 * params["m"] ** 2 * params["n"]
    return (flops if params["what"] == "bound" else 3 * flops), "float64"


def _inputs(params: dict) -> dict[str, np.ndarray]:
    x, y, z = ex.make_data(params["n"], params["m"], params["d"], seed=0)
    return {"x": x, "y": y, **ex.default_params(z, params["d"])}


def run_case(method: str, params: dict) -> dict[str, Any]:
    data = _inputs(params)
    what = params["what"]
    if method == "gpflow":
        from benchmarks import gpflow_env

        res = gpflow_env.run(data, "bench", what=what, repeats=params["repeats"])
        times = res["times_s"]
        return {
            "first_s": res["first_call_s"],
            "times_s": times,
            "min_s": min(times),
            "median_s": float(np.median(times)),
            "value": res["bound"],
            "peak_rss_bytes": res["peak_rss_bytes"],
            "rss_growth_bytes": res["peak_rss_bytes"] - res["rss_before_bytes"],
            "versions": res["versions"],
        }
    fun = ex.sgpr_elbo if what == "bound" else ex.sgpr_elbo_and_grad
    with jax.enable_x64(True):
        theta = {k: jnp.asarray(data[k]) for k in ("variance", "lengthscales", "noise", "Z")}
        args = (theta, jnp.asarray(data["x"]), jnp.asarray(data["y"]))
        if method == "jax":
            out, info = run_jax(fun, args, params)
        elif method == "memsafe":
            out, info = run_memsafe(fun, args, params)
        else:
            raise ValueError(f"sgpr: unknown method {method!r}")
        if out is not None:
            value = out if what == "bound" else out[0]
            info["value"] = float(value)
            if what == "grad":
                info["grad"] = {k: np.asarray(v).ravel()[:8].tolist() for k, v in out[1].items()}
                info["grad_norms"] = {k: float(jnp.linalg.norm(v)) for k, v in out[1].items()}
    return info


def postprocess(case: dict, results: dict[str, dict]) -> None:
    """Relative difference of each method's bound to the reference method's (GPflow if run)."""
    ref = results.get(case["reference"], {}).get("value")
    if ref is None:
        ref = results.get("jax", {}).get("value")
    if ref is None:
        return
    for info in results.values():
        if info.get("value") is not None:
            info.setdefault("accuracy", {})["bound_relative_difference"] = abs(
                info["value"] - ref
            ) / abs(ref)
