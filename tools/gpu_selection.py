"""The tiled top-k selection (:mod:`memsafe.split.strategies.selection`) against the stored chunk,
on one device or a mesh: the same L2 kNN under the same limit, planned once with the tiled selection
and once without it, timed in one process.

    python -m tools.gpu_selection                       # 10k x 1M x 64, k=10, 1 GiB
    python -m tools.gpu_selection --n 2000 --m 262144 --limit 64MiB --mesh 8   # 8 CPU devices
    python -m tools.gpu_selection --n 2000 --m 65536    # smaller, for a CPU smoke run

Prints one JSON object: per variant its first call (planning and compiling), the fastest and
median of the timed calls, the plan's chunks and footprint; and how many neighbour indices the
two variants share (the passes round the distances in different products, see the module doc).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any


@contextmanager
def _without_tiles():
    """memsafe plans every loop as if no top_k could run in tiles."""
    from memsafe.split.strategies import selection

    saved = selection.plan
    selection.plan = lambda *args, **kwargs: None
    try:
        yield
    finally:
        selection.plan = saved


def _variant(fun, x, y, limit: str, repeats: int, mesh: Any = None) -> tuple[Any, dict]:
    import jax

    import memsafe

    memsafe.cache.clear()
    safe = memsafe.jit(fun, memory_limit=limit, mesh=mesh)
    start = time.perf_counter()
    out = jax.block_until_ready(safe(x, y))
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(safe(x, y))
        times.append(time.perf_counter() - start)
    plan = safe.plan(x, y)
    return out, {
        "first_s": first,
        "min_s": min(times),
        "median_s": statistics.median(times),
        "footprint": plan.after.total,
        "plan": str(plan).splitlines()[:12],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--m", type=int, default=1_000_000)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--limit", default="1GiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--mesh", type=int, default=0, help="devices of a 1-D mesh (CPU: host)")
    args = parser.parse_args(argv)
    if args.mesh:  # before JAX starts: on the CPU, that many host devices
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.mesh}"

    import jax
    import numpy as np
    from jax.sharding import Mesh

    from examples import knn as ex

    x, y = (jax.device_put(a) for a in ex.make_inputs(args.n, args.m, args.d))
    fun = functools.partial(ex.FUNCTIONS["l2_expanded"], k=args.k)
    mesh = Mesh(np.array(jax.devices()[: args.mesh]), ("d",)) if args.mesh else None
    result: dict[str, Any] = {
        "device": jax.devices()[0].device_kind,
        "jax": jax.__version__,
        "shape": [args.n, args.m, args.d, args.k],
        "limit": args.limit,
        "mesh_devices": args.mesh or None,
    }
    (_, tiled_idx), result["tiled"] = _variant(fun, x, y, args.limit, args.repeats, mesh)
    with _without_tiles():
        (_, stored_idx), result["stored"] = _variant(fun, x, y, args.limit, args.repeats, mesh)
    result["same_indices"] = float(np.mean(np.asarray(tiled_idx) == np.asarray(stored_idx)))
    result["stored_over_tiled"] = result["stored"]["min_s"] / result["tiled"]["min_s"]
    result["load_average"] = os.getloadavg()
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
