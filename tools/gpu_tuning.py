"""The planner's speed constants (:mod:`memsafe.split.speed`) measured on one device, to set
them per backend:

- ``chunk_bytes``, the cap on a memory-bound chunk's modelled bytes, on the Gaussian-kernel
  matvec (beside the hand-chunked ``lax.map`` peer);
- ``tile_bytes``, the width of the tiled top-k selection's tiles, on the L2 kNN (beside the
  stored chunk, no tiles).

    python -m tools.gpu_tuning > tuning.json         # the GPU sizes
    python -m tools.gpu_tuning --small               # a smoke run on the CPU

Each variant is planned once with its constant set, under a limit one byte apart from the others
(so that memsafe's program cache keeps them apart), then all variants of a workload are timed in
turn, ``--rounds`` times, in this one process. Prints one JSON object: per variant its first call
(planning and compiling), each round's time, its chunks and footprint, and its relative error
against the first variant (the current constant).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

MiB = 2**20


@contextmanager
def _constant(module: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _speed(**changes: int) -> Any:
    """A context in which the planner's speed constants are this backend's with ``changes``."""
    from memsafe.split import speed

    changed = dataclasses.replace(speed.current(), **changes)
    return _constant(speed, "current", lambda: changed)


def _planned(fun: Callable, args: tuple, limit: int, setting: Callable[[], Any]) -> dict:
    """``memsafe.jit(fun)`` planned and called once under ``setting``."""
    import jax

    import memsafe

    safe = memsafe.jit(fun, memory_limit=limit)
    with setting():
        start = time.perf_counter()
        out = jax.block_until_ready(safe(*args))
        first = time.perf_counter() - start
        plan = safe.plan(*args)
    split = plan.splits[0] if plan.splits else None
    return {
        "call": lambda: jax.block_until_ready(safe(*args)),
        "out": out,
        "first_s": first,
        "footprint": plan.after.total,
        "loops": None if split is None else split.loops,
        "chunk": None if split is None else split.chunk,
    }


def _timed_rounds(variants: dict[str, dict], rounds: int) -> None:
    """Each variant's call timed in turn, ``rounds`` times (variants alternate)."""
    for _ in range(rounds):
        for v in variants.values():
            start = time.perf_counter()
            v["call"]()
            v.setdefault("times_s", []).append(time.perf_counter() - start)


def _report(variants: dict[str, dict]) -> dict:
    import numpy as np

    base = None
    report = {}
    for name, v in variants.items():
        out = np.asarray(v["out"][0] if isinstance(v["out"], tuple) else v["out"], np.float64)
        base = out if base is None else base
        error = float(np.max(np.abs(out - base)) / max(np.max(np.abs(base)), 1e-30))
        report[name] = {k: v[k] for k in ("first_s", "footprint", "loops", "chunk", "times_s")}
        report[name]["min_s"] = min(v["times_s"])
        report[name]["relative_to_first_variant"] = error
    return report


def speed_cap(n: int, limit: int, rounds: int, caps: dict[str, int]) -> dict:
    """The kernel matvec at n=m, d=3, under ``limit``: memsafe at several speed caps."""
    import jax
    import numpy as np

    from benchmarks.peers import chunked_jax
    from examples import kernel_matvec as ex

    x, y, v = (jax.device_put(a) for a in ex.make_inputs(n, n, 3))
    ls = jax.device_put(np.float32(0.5))
    args = (x, y, v, ls)
    variants = {
        f"memsafe cap {name}": _planned(
            ex.gaussian_kernel_matvec,
            args,
            limit - i,
            functools.partial(_speed, chunk_bytes=cap),
        )
        for i, (name, cap) in enumerate(caps.items())
    }
    peer = chunked_jax.jit(chunked_jax.gaussian_kernel_matvec, ynn=False, static_argnums=4)
    start = time.perf_counter()
    out = jax.block_until_ready(peer(*args, 256))
    variants["lax.map batch 256"] = {
        "call": lambda: jax.block_until_ready(peer(*args, 256)),
        "out": out,
        "first_s": time.perf_counter() - start,
        "footprint": None,
        "loops": None,
        "chunk": 256,
    }
    _timed_rounds(variants, rounds)
    return {"n": n, "limit": limit, "variants": _report(variants)}


def tile_width(n: int, m: int, limit: int, rounds: int, tiles: dict[str, int]) -> dict:
    """The L2 kNN (expanded) n x m x 64, k=10, under ``limit``: tiles of several widths."""
    import jax

    from examples import knn as ex
    from memsafe.split.strategies import selection

    x, y = (jax.device_put(a) for a in ex.make_inputs(n, m, 64))
    fun = functools.partial(ex.FUNCTIONS["l2_expanded"], k=10)
    variants = {
        f"tiles {name}": _planned(
            fun, (x, y), limit - i, functools.partial(_speed, tile_bytes=tile)
        )
        for i, (name, tile) in enumerate(tiles.items())
    }
    no_tiles = functools.partial(_constant, selection, "plan", lambda *a, **k: None)
    variants["stored chunks"] = _planned(fun, (x, y), limit - len(tiles), no_tiles)
    _timed_rounds(variants, rounds)
    report = _report(variants)
    base = next(iter(variants.values()))["out"][1]
    for name, v in variants.items():  # near-ties fall either way at TF32 (see gpu_selection)
        report[name]["same_indices"] = float((v["out"][1] == base).mean())
    return {"n": n, "m": m, "limit": limit, "variants": report}


def _mib(values: str) -> dict[str, int]:
    """``"32,128,off"`` as {"32MiB": 32 MiB, ..., "off": no cap}."""
    return {(f"{v}MiB" if v != "off" else v): (int(v) * MiB if v != "off" else 1 << 62)
            for v in values.split(",")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="CPU-sized smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=("cap", "tiles"), default=None)
    parser.add_argument("--caps", default="32,128,512", help="speed caps, MiB (off: none)")
    parser.add_argument("--tiles", default="10,40,160,640", help="tile widths, MiB")
    parser.add_argument("--matvec", default="100000,1000000", help="kernel matvec sizes n=m")
    args = parser.parse_args(argv)

    import jax

    result: dict[str, Any] = {"device": jax.devices()[0].device_kind, "jax": jax.__version__}
    if args.only in (None, "tiles"):
        sizes = (2_000, 65_536, 64 * MiB) if args.small else (10_000, 1_000_000, 1 << 30)
        result["tile_width"] = tile_width(*sizes, args.rounds, _mib(args.tiles))
        print(json.dumps(result["tile_width"]), file=sys.stderr, flush=True)
    if args.only in (None, "cap"):
        for n in (5_000,) if args.small else map(int, args.matvec.split(",")):
            limit = 64 * MiB if args.small else 1 << 30
            run = speed_cap(n, limit, args.rounds, _mib(args.caps))
            result.setdefault("speed_cap", []).append(run)
            print(json.dumps(result["speed_cap"][-1]), file=sys.stderr, flush=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
