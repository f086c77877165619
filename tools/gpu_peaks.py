"""Where a memsafe call's device peak comes from: the allocator's peak after placing the inputs,
after planning (every attempt compiled, nothing run) and after the first call, for the attention
check of tools/gpu_checks.py (L=8192, 8 heads, d=64, 256 MiB)."""

from __future__ import annotations

import json
import sys

from tools.gpu_checks import MiB, _mesh, _peak, _setup


def main() -> int:
    _setup()  # the GPU, allocating as it goes, as tools/gpu_checks runs its checks
    import jax
    import numpy as np

    import memsafe
    from tests import mesh_checks as mc

    rng = np.random.default_rng(3)
    q, k, v = (jax.device_put(rng.standard_normal((8, 8192, 64)).astype(np.float32)) for _ in "qkv")
    out = {"inputs": _peak()}
    for name, mesh in (("mesh", _mesh()), ("no_mesh", None)):
        memsafe.cache.clear()
        f = memsafe.jit(mc.attention, memory_limit=256 * MiB, mesh=mesh)
        plan = f.plan(q, k, v)
        out[name + "_planned"] = _peak()
        jax.block_until_ready(f(q, k, v))
        out[name + "_called"] = _peak()
        out[name + "_footprint"] = plan.after.total
        out[name + "_attempts"] = [str(a)[:200] for a in getattr(plan, "attempts", [])]
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
