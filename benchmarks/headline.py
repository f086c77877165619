"""The headline, on the CPU in a minute or two: a kNN that jax.jit cannot fit under the limit,
memsafe.jit running the same naive code under it, and the peers' times beside it.

``python -m benchmarks.headline [--n 4096 --m 250000 --d 64 --limit 256MiB]``; the lead's
``make demo`` calls :func:`main`. faiss-cpu is used when installed (the ``bench`` extra); the
hand-chunked JAX peer always runs.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import memsafe
from benchmarks.peers import chunked_jax
from examples import knn


def _best_of(fn: Callable[[], Any], repeats: int = 2) -> tuple[Any, float]:
    out = jax.block_until_ready(fn())  # warm-up: compilation
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return out, best


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the headline and print it; returns the numbers (bytes, seconds, recall)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=4096, help="queries")
    parser.add_argument("--m", type=int, default=250_000, help="database points")
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--limit", default="256MiB")
    args = parser.parse_args(argv)
    limit = memsafe.parse_limit(args.limit)

    x, y = knn.make_inputs(args.n, args.m, args.d)
    fun = functools.partial(knn.knn_l2, k=args.k)  # the naive broadcast form
    print(
        f"kNN, naive broadcast form: n={args.n} queries, m={args.m} points, d={args.d}, "
        f"k={args.k}, float32; memory limit {memsafe.format_bytes(limit)}"
    )
    print("    d2 = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1); lax.top_k(-d2, k)")

    # With XLA's YNNPACK fusions on (JAX's CPU default) the difference fuses into the reduction
    # and only the n x m distance matrix is stored; with them off (as memsafe compiles) XLA also
    # stores the n x m x d difference.
    need_default = memsafe.Footprint.from_compiled(jax.jit(fun).lower(x, y).compile()).total
    compiled = memsafe.xla.memsafe_jit(fun).lower(x, y).compile()
    need = memsafe.Footprint.from_compiled(compiled).total
    print(
        f"\njax.jit would need {memsafe.format_bytes(need_default)} with its default options "
        f"({need_default / limit:.0f}x the limit; {memsafe.format_bytes(need)} with YNNPACK "
        "fusions off), from memory_analysis(); not run."
    )

    safe = memsafe.jit(fun, memory_limit=limit)
    start = time.perf_counter()
    plan = safe.plan(x, y)
    build = time.perf_counter() - start
    (dist, idx), t_memsafe = _best_of(lambda: safe(x, y))
    print(
        f"memsafe.jit: footprint {memsafe.format_bytes(plan.after.total)} <= limit; "
        f"rewrite + verify {build:.1f} s; run {t_memsafe:.2f} s"
    )
    for rec in (*plan.rules, *plan.splits):
        print(f"    {rec.describe()}")

    rows = np.random.default_rng(1).choice(args.n, size=32, replace=False)
    acc = knn.neighbour_errors(x, y, "l2", np.asarray(dist), np.asarray(idx), rows)
    print(f"    recall on {rows.size} sampled queries against exact float64: {acc['recall']:.3f}")

    result: dict[str, Any] = {
        "jax_need_bytes": need_default,
        "jax_need_ynn_off_bytes": need,
        "limit_bytes": limit,
        "memsafe_footprint_bytes": plan.after.total,
        "memsafe_s": t_memsafe,
        "recall": acc["recall"],
    }
    print("\npeers (same machine, same run):")
    hand = chunked_jax.make_knn("database", "l2", args.k, ynn=False, chunk=4096)
    _, t_hand = _best_of(lambda: hand(x, y))
    result["hand_chunked_s"] = t_hand
    print(
        f"    hand-chunked JAX (scan over database chunks, running top-k): {t_hand:.2f} s "
        f"-> memsafe is {t_hand / t_memsafe:.2f}x its speed"
    )
    try:
        from benchmarks.peers import faiss_knn

        _, t_faiss = _best_of(lambda: faiss_knn.knn(x, y, args.k), repeats=1)
        result["faiss_s"] = t_faiss
        print(
            f"    faiss-cpu IndexFlatL2: {t_faiss:.2f} s -> memsafe is "
            f"{t_faiss / t_memsafe:.2f}x its speed"
        )
    except ImportError:
        print("    faiss-cpu not installed (pip install -e '.[bench]'): skipped")
    return result


if __name__ == "__main__":
    main()
