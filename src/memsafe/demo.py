"""``make demo``: what memsafe shows about a naive k-nearest-neighbour search, on the CPU.

Nothing large is run: the programs are compiled and inspected, memsafe.jit's plan is built and its
memory timeline drawn beside the plain program's. Run as ``python -m memsafe.demo [--out DIR]``;
the HTML report is written to DIR (default: the current directory). ``make demo`` then runs
``benchmarks.headline`` at the same size. The README quotes this size and these numbers.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp

import memsafe
from memsafe.limits import format_bytes

#: The demo's sizes (the README's and the headline's): 2000 queries, 200000 points, 64
#: dimensions, 10 neighbours, under a 256 MiB limit.
N_QUERIES, N_POINTS, DIM, K = 2000, 200_000, 64, 10
LIMIT = "256MiB"


def knn(x: jax.Array, y: jax.Array, k: int = K) -> tuple[jax.Array, jax.Array]:
    """The obvious k-nearest-neighbour search: all pairwise squared distances, then top-k."""
    d = jnp.sum((x[:, None] - y[None]) ** 2, -1)
    return jax.lax.top_k(-d, k)


def knn_arguments() -> tuple[jax.ShapeDtypeStruct, jax.ShapeDtypeStruct]:
    return (
        jax.ShapeDtypeStruct((N_QUERIES, DIM), jnp.float32),
        jax.ShapeDtypeStruct((N_POINTS, DIM), jnp.float32),
    )


def section(title: str) -> None:
    print(f"\n{'=' * 100}\n{title}\n{'=' * 100}")


def inspect_knn(out_dir: Path) -> memsafe.Report:
    """Print the kNN report (memsafe's compiler options) and write its HTML page."""
    section(
        f"memsafe.inspect(knn, f32[{N_QUERIES},{DIM}], f32[{N_POINTS},{DIM}],"
        f" memory_limit={LIMIT!r})"
    )
    start = time.perf_counter()
    report = memsafe.inspect(knn, *knn_arguments(), memory_limit=LIMIT)
    print(report)
    path = out_dir / "demo_knn_report.html"
    report.save(str(path))
    print(f"\nHTML report written to {path} ({time.perf_counter() - start:.1f} s)")
    return report


def compare_modes() -> None:
    """The same program under XLA's default CPU options: a different graph, a different peak."""
    section("The same kNN with XLA's default CPU options (YNNPACK fusions on)")
    report = memsafe.inspect(knn, *knn_arguments(), compiler_options=None)
    for kernel in report.kernels:
        print(f"  {kernel.name:<14} {kernel.label:<20} writes {kernel.shape}")
    print(f"  footprint: {report.footprint.describe()}")
    print(
        "  XLA's default CPU fusions compute the distances without storing the difference, but"
        " their own buffers are not all counted by memory_analysis(); memsafe compiles with them"
        " off so that the footprint it verifies is the one the process uses."
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="directory for the HTML report")
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = inspect_knn(out_dir)
    compare_modes()
    largest = report.temporaries[0]
    section("Summary")
    print(
        f"  naive kNN: footprint {format_bytes(report.footprint.total)};"
        f" largest temporary {largest.describe()} made by {largest.producer}"
    )
    if report.plan is not None and report.plan.after is not None:
        splits = report.plan.splits
        chunks = f" in {splits[0].loops} chunks" if splits else ""
        print(
            f"  memsafe.jit under {LIMIT}: footprint {format_bytes(report.plan.after.total)}"
            f"{chunks}; memory timeline peaks: "
            + ", ".join(f"{t.name} {format_bytes(t.peak)}" for t in report.timelines)
        )


if __name__ == "__main__":
    main()
