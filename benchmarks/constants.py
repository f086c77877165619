"""Compile time and footprint of seed 002's f_numpy under jax.jit and memsafe.jit.

Run: ``.venv/bin/python benchmarks/constants.py [rows]`` (default 4M rows x 2 float32). Prints the
compile seconds of jax.jit(f_numpy), of memsafe.jit's whole build (compile the original, rewrite,
compile and verify), of the rewritten program alone, and of jax.jit(f) (the jnp version), with the
footprints memory_analysis() gives (plus the hidden constant memsafe counts).
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import jax
import jax.numpy as jnp

import memsafe
from examples.seed002 import f, f_numpy
from memsafe._jax import eval_jaxpr
from memsafe.xla import Footprint, hidden_constant_bytes, memsafe_jit


def _timed_compile(fun, *args):
    start = time.perf_counter()
    compiled = memsafe_jit(fun).lower(*args).compile()
    return time.perf_counter() - start, compiled


def main(rows: int = 4 * 1024 * 1024) -> None:
    x = jnp.zeros((rows, 2), jnp.float32)
    hidden = hidden_constant_bytes(jax.make_jaxpr(f_numpy)(x).consts)
    t_numpy, c_numpy = _timed_compile(lambda a: f_numpy(a), x)
    t_jnp, c_jnp = _timed_compile(lambda a: f(a), x)
    fp_numpy = Footprint.from_compiled(c_numpy, hidden)
    limit = Footprint.from_compiled(c_jnp).total + 1024 * 1024
    g = memsafe.jit(f_numpy, memory_limit=limit)
    start = time.perf_counter()
    plan = g.plan(x)
    t_build = time.perf_counter() - start
    program = next(iter(g._programs.values())).closed
    t_rewritten, _ = _timed_compile(lambda a: eval_jaxpr(program.jaxpr, program.consts, a), x)
    print(f"x: f32{list(x.shape)}; hidden constant {hidden} B")
    print(f"jax.jit(f_numpy)   compile {t_numpy:7.3f} s  footprint {fp_numpy.describe()}")
    print(f"memsafe.jit build  total   {t_build:7.3f} s  (compiles the original once)")
    print(f"  its program      compile {t_rewritten:7.3f} s  footprint {plan.after.describe()}")
    print(
        f"jax.jit(f) (jnp)   compile {t_jnp:7.3f} s  "
        f"footprint {Footprint.from_compiled(c_jnp).describe()}"
    )
    for rec in plan.passes:
        print("  " + rec.describe())


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4 * 1024 * 1024)
