"""The headline, on the CPU in a minute or two: a kNN that jax.jit cannot fit under the limit,
memsafe.jit running the same naive code under it, and the peers' times beside it.

``python -m benchmarks.headline [--n 2000 --m 200000 --d 64 --limit 256MiB]`` (the defaults are
the demo's and the README's size, :mod:`memsafe.demo`); ``make demo`` runs it after the demo.
faiss-cpu is used when installed (the ``bench`` extra); the hand-chunked JAX peer always runs;
plain ``jax.jit`` runs when its footprint fits in half the machine's memory.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

import memsafe
from benchmarks.measure import WARM_UP_CALLS
from benchmarks.peers import chunked_jax
from examples import knn
from memsafe import demo
from memsafe.sources import shorten_paths

#: jax.jit is run when its footprint is at most this fraction of the machine's memory.
JAX_RUN_FRACTION = 0.5


def _best_of(fn: Callable[[], Any], repeats: int = 2, warm_up: int = 1) -> tuple[Any, float]:
    for _ in range(warm_up):  # compilation (and memsafe's trial of compile options)
        out = jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - start)
    return out, best


def _jax_jit_time(fun: Callable, x: Any, y: Any, need: int, t_memsafe: float) -> float | None:
    """Time plain ``jax.jit`` (default options) when its footprint fits in the machine's memory;
    returns the seconds, or None when it is not run."""
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > JAX_RUN_FRACTION * memory:
        print(
            f"    jax.jit: not run ({memsafe.format_bytes(need)} is over half of this machine's"
            f" {memsafe.format_bytes(memory)})"
        )
        return None
    plain = jax.jit(fun)
    _, seconds = _best_of(lambda: plain(x, y), repeats=1)
    print(
        f"    jax.jit (default options, over the limit): {seconds:.2f} s -> memsafe is "
        f"{seconds / t_memsafe:.2f}x its speed"
    )
    return seconds


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the headline and print it; returns the numbers (bytes, seconds, recall)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=demo.N_QUERIES, help="queries")
    parser.add_argument("--m", type=int, default=demo.N_POINTS, help="database points")
    parser.add_argument("--d", type=int, default=demo.DIM)
    parser.add_argument("--k", type=int, default=demo.K)
    parser.add_argument("--limit", default=demo.LIMIT)
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
        f"\njax.jit needs {memsafe.format_bytes(need_default)} with its default options "
        f"({need_default / limit:.0f}x the limit; {memsafe.format_bytes(need)} with YNNPACK "
        "fusions off), from memory_analysis()."
    )

    safe = memsafe.jit(fun, memory_limit=limit)
    start = time.perf_counter()
    plan = safe.plan(x, y)
    build = time.perf_counter() - start
    (dist, idx), t_memsafe = _best_of(lambda: safe(x, y), warm_up=WARM_UP_CALLS)
    print(
        f"memsafe.jit: footprint {memsafe.format_bytes(plan.after.total)} <= limit; "
        f"rewrite + verify {build:.1f} s; run {t_memsafe:.2f} s"
    )
    for rec in (*plan.rules, *plan.splits):
        print(f"    {shorten_paths(rec.describe())}")

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
    result["jax_jit_s"] = _jax_jit_time(fun, x, y, need_default, t_memsafe)
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
