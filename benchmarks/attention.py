"""Multi-head attention, forward and forward+backward: memsafe on the textbook code against a
hand-written chunked memory-efficient attention (Rabe & Staats 2021), and plain jax.jit where it
fits. Full size: L=32,768, 8 heads, d=64 under 2 GiB (the scores alone are 32 GiB)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from benchmarks.measure import on_device, run_jax, run_memsafe
from examples import attention as ex

METHODS = ("jax", "memsafe", "chunked")


def cases(size: str) -> list[dict]:
    if size == "quick":
        grid = [(2048, "256MiB"), (8192, "256MiB")]
    elif size == "full":
        grid = [(4096, "2GiB"), (32_768, "2GiB")]
    elif size == "gpu":
        grid = [(8192, "2GiB"), (32_768, "2GiB")]
    else:
        raise ValueError(f"unknown size {size!r}; expected 'quick', 'full' or 'gpu'")
    out = []
    for length, limit in grid:
        for mode in ("forward", "backward"):
            out.append(
                {
                    "label": f"{mode} L={length}",
                    "mode": mode,
                    "L": length,
                    "heads": 8,
                    "d": 64,
                    "causal": False,
                    "limit": limit,
                    "methods": list(METHODS),
                }
            )
    return out


def gemm_flops(params: dict) -> tuple[float, str]:
    """The products of attention: q k^T and p v forward (4 h L^2 d); with the gradient, four more
    of the same size (dv, dp, dq, dk: 12 h L^2 d in all, no recomputation counted), float32."""
    per = 2.0 * params["heads"] * params["L"] ** 2 * params["d"]
    return (2 if params["mode"] == "forward" else 6) * per, "float32"


def run_case(method: str, params: dict) -> dict[str, Any]:
    q_np, k_np, v_np = ex.make_inputs(params["heads"], params["L"], params["d"])
    q, k, v = on_device(q_np, k_np, v_np)
    causal, forward = params["causal"], params["mode"] == "forward"
    if method == "chunked":
        from benchmarks.peers import chunked_attention as ca

        qc, kc = params.get("query_chunk", 1024), params.get("key_chunk", 4096)
        base = ca.attention if forward else ca.attention_value_and_grad
        fun = functools.partial(base, causal=causal, query_chunk=qc, key_chunk=kc)
        out, info = run_jax(fun, (q, k, v), {**params, "jax_cap": 2**62})
        info.update(query_chunk=qc, key_chunk=kc)
    else:
        base = ex.attention if forward else ex.attention_value_and_grad
        fun = functools.partial(base, causal=causal)
        if method == "jax":
            out, info = run_jax(fun, (q, k, v), params)
        elif method == "memsafe":
            out, info = run_memsafe(fun, (q, k, v), params)
        else:
            raise ValueError(f"attention: unknown method {method!r}")
    if out is not None:
        rows = np.random.default_rng(1).choice(params["L"], size=64, replace=False)
        ref = ex.reference(q_np, k_np, v_np, causal, rows)
        if forward:
            got = np.asarray(out)[:, rows]
        else:
            loss, grads = out
            info["loss"] = float(loss)
            info["grad_norms"] = [float(np.linalg.norm(np.asarray(g))) for g in grads]
            got = None
        if got is not None:
            info["accuracy"] = {"max_abs_error": float(np.max(np.abs(got - ref)))}
    return info


def postprocess(case: dict, results: dict[str, dict]) -> None:
    """Backward cases: relative difference of loss and gradient norms to the chunked peer's."""
    ref = results.get("chunked", {})
    if "loss" not in ref:
        return
    for info in results.values():
        if "loss" in info:
            diffs = [abs(a - b) / abs(b) for a, b in zip(info["grad_norms"], ref["grad_norms"])]
            info.setdefault("accuracy", {}).update(
                loss_relative_difference=abs(info["loss"] - ref["loss"]) / abs(ref["loss"]),
                grad_norm_relative_difference=max(diffs),
            )
