"""The kNN of tests/mesh_checks.py on one mesh spread over several processes on this machine
(``jax.distributed`` with the gloo CPU collectives), each process's answer and peak RSS.

    python -m tools.mesh_processes --processes 2 --devices 4       # 2 x 4 host devices
    python -m tools.mesh_processes --processes 8 --devices 1       # per-device peak memory

Every process computes the same neighbours as one process does; each reports, phase by phase,
how far its resident memory peaked over the memory the phase started with, what it left, and
the XLA compiles so far. The phases separate what any JAX program on the mesh costs (the inputs
placed, a jax.jit program with a collective compiled and run) from memsafe's planning and its
calls, so a call's growth can be compared with the compiled per-device footprint.

Measured (8 processes of one device, the 64 x 65536 x 64 kNN at 6 MiB per device, footprint
3.54 MiB): a process starts at 179 MiB resident; ``jax.device_put`` of the host database onto
the global mesh peaks 318 MiB over that (it gathers every process's copy to check they are
equal) and 2 compiles; memsafe's planning peaks 106-126 MiB over its start (6 compiles); the
first call on placed inputs 11-14 MiB, with no compile; a call on host inputs, which memsafe
places itself without the gather, 2-4 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from typing import Any

import numpy as np


def free_port() -> int:
    """A TCP port free on localhost now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Memory:
    """The process's resident memory at the end of each phase and its peak during the phase
    (Linux: ``VmRSS`` and ``VmHWM`` of ``/proc/self/status``, the peak reset between phases
    through ``/proc/self/clear_refs``), and the XLA compiles counted by JAX's monitoring."""

    compiles = 0

    def __init__(self) -> None:
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        self.phases: dict[str, dict[str, int]] = {}
        self._reset()

    @classmethod
    def _on_event(cls, event: str, _duration: float, **_: object) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            cls.compiles += 1

    @staticmethod
    def _reset() -> None:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident size starts again from the current one

    @staticmethod
    def now() -> dict[str, int]:
        """Current (VmRSS) and peak (VmHWM) resident bytes."""
        fields = {}
        with open("/proc/self/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    fields[key] = int(value.split()[0]) * 1024
        return {"rss": fields["VmRSS"], "peak": fields["VmHWM"]}

    def mark(self, phase: str) -> None:
        """End ``phase``: its peak, the memory it left and the compiles so far."""
        start = list(self.phases.values())[-1]["rss"] if self.phases else self.now()["rss"]
        self.phases[phase] = {**self.now(), "start": start, "compiles": self.compiles}
        self._reset()


def baseline(x: np.ndarray, y: np.ndarray, mesh: Any, memory: Memory) -> tuple[Any, Any]:
    """Everything a run does except memsafe's work, in phases: the inputs placed on the mesh
    as memsafe places them (the database sharded), and a jax.jit program over them whose
    result needs a collective (gloo), compiled then run; the placed inputs."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    xs = jax.device_put(x, NamedSharding(mesh, P()))
    ys = jax.device_put(y, NamedSharding(mesh, P("d")))
    memory.mark("inputs placed")
    total = jax.jit(lambda a, b: jnp.max(b @ a[0]), out_shardings=NamedSharding(mesh, P()))
    compiled = total.lower(xs, ys).compile()
    memory.mark("jax.jit compiled")
    jax.block_until_ready(compiled(xs, ys))
    memory.mark("jax.jit ran")
    return xs, ys


def worker(args: argparse.Namespace) -> None:
    """One process: join the distributed run, then measure each phase's memory: the baseline
    (inputs placed, a jax.jit program with a collective), memsafe's planning and compiles, the
    call on the placed inputs, and a call on host arrays (placed by memsafe)."""
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

    memory = Memory()
    x, y = knn_data(args.queries, args.points, args.dim)
    mesh = Mesh(np.array(jax.devices()), ("d",))
    memory.mark("started")
    xs, ys = baseline(x, y, mesh, memory)
    f = memsafe.jit(knn, memory_limit=args.limit, mesh=mesh)
    footprint = f.plan(x, y).after.total
    memory.mark("memsafe planned")
    jax.block_until_ready(f(xs, ys))
    memory.mark("memsafe call")
    idx = np.asarray(jax.device_get(f(x, y)[1]))
    memory.mark("memsafe call, host inputs")
    report = {"rank": args.rank, "idx": idx.tolist(), "footprint": footprint}
    print(json.dumps({**report, "phases": memory.phases}))


def growth(phase: dict[str, int]) -> int:
    """How far a phase's peak resident memory rose over the memory it started with."""
    return phase["peak"] - phase["start"]


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
        print(f"process {r['rank']}: footprint per device {r['footprint'] / 2**20:.2f} MiB")
        for phase, m in r["phases"].items():
            rss, compiles = m["rss"] / 2**20, m["compiles"]
            print(f"  {phase:>26}: peak {growth(m) / 2**20:+7.1f} MiB over its start, "
                  f"left {rss:6.1f} MiB resident; XLA compiles {compiles}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
