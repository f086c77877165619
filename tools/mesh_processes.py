"""The kNN of tests/mesh_checks.py on one mesh spread over several processes on this machine
(``jax.distributed`` with the gloo CPU collectives), each process's answer and peak RSS.

    python -m tools.mesh_processes --processes 2 --devices 4       # 2 x 4 host devices
    python -m tools.mesh_processes --processes 8 --devices 1       # per-device peak memory

Every process computes the same neighbours as one process does; each prints its peak RSS
(``resource.getrusage``) and how much the run grew it once planned and compiled: the memory one
device's process really used for the run.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import numpy as np


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def worker(args: argparse.Namespace) -> None:
    """One process: join the distributed run, plan and run the kNN on the global mesh."""
    import resource

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}",
        num_processes=args.processes,
        process_id=args.rank,
    )
    from jax.sharding import Mesh

    import memsafe
    from tests.mesh_checks import knn, knn_data

    x, y = knn_data(args.queries, args.points, args.dim)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    f = memsafe.jit(knn, memory_limit=args.limit, mesh=mesh)
    f.plan(x, y)  # planned and compiled: the run below is what the peak grows by
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    _, idx = f(x, y)
    idx = np.asarray(jax.device_get(idx))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = {"rank": args.rank, "idx": idx.tolist(), "rss": rss, "growth": rss - before}
    print(json.dumps({**report, "footprint": f.plan(x, y).after.total}))


def launch(args: argparse.Namespace) -> list[dict]:
    """Start ``args.processes`` workers on a free port; their reports."""
    port = free_port()
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}",
    )
    base = [sys.executable, "-m", "tools.mesh_processes", "--worker", "--port", str(port)]
    for name in ("processes", "devices", "queries", "points", "dim", "limit"):
        base += [f"--{name}", str(getattr(args, name))]
    procs = [
        subprocess.Popen([*base, "--rank", str(r)], env=env, stdout=subprocess.PIPE, text=True)
        for r in range(args.processes)
    ]
    reports = []
    for p in procs:
        out, _ = p.communicate(timeout=args.timeout)
        if p.returncode:
            raise RuntimeError(f"a worker failed with exit code {p.returncode}")
        reports.append(json.loads(out.strip().splitlines()[-1]))
    return reports


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--devices", type=int, default=4, help="host devices per process")
    parser.add_argument("--queries", type=int, default=64)
    parser.add_argument("--points", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--limit", type=int, default=6 * 2**20, help="bytes per device")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    for r in launch(args):
        print(f"process {r['rank']}: peak RSS {r['rss'] / 2**20:.1f} MiB, grown by the run "
              f"{r['growth'] / 2**20:.1f} MiB; compiled footprint per device "
              f"{r['footprint'] / 2**20:.2f} MiB")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
