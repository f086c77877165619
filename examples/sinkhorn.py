"""Entropic optimal transport by Sinkhorn iterations, written as users write them.

The cost matrix ``C[i, j] = |x_i - y_j|^2`` is made once, outside the loop, and every iteration
reduces it along its rows (the potential ``f``) and then along its columns (``g``), in the log
domain. At n = m = 50,000 the matrix is 9.3 GiB in float32 and each iteration makes two more
of its size. memsafe.jit makes the matrix inside the loop, chunk by chunk, as KeOps and
geomloss do by hand.

Run as a script: ``python -m examples.sinkhorn --n 20000 --m 20000 --limit 64MiB``.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np


def sinkhorn(
    x: jax.Array, y: jax.Array, eps: float | jax.Array = 0.05, steps: int = 10
) -> tuple[jax.Array, jax.Array]:
    """The dual potentials (f (n,), g (m,)) after ``steps`` log-domain Sinkhorn iterations
    between uniform weights on the points x (n, d) and y (m, d), cost ``|x_i - y_j|^2``."""
    n, m = x.shape[0], y.shape[0]
    cost = jnp.sum((x[:, None, :] - y[None, :, :]) ** 2, axis=-1)
    log_a, log_b = -jnp.log(n) * jnp.ones(n), -jnp.log(m) * jnp.ones(m)

    def step(i: jax.Array, fg: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        _, g = fg
        f = -eps * jax.nn.logsumexp((g[None, :] - cost) / eps + log_b[None, :], axis=1)
        g = -eps * jax.nn.logsumexp((f[:, None] - cost) / eps + log_a[:, None], axis=0)
        return f, g

    return jax.lax.fori_loop(0, steps, step, (jnp.zeros(n), jnp.zeros(m)))


def make_inputs(n: int, m: int, d: int = 3, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Two clouds in the unit cube, the second shifted by 0.2 along every axis."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(0, 1, (n, d)).astype(np.float32)
    y = (rng.uniform(0, 1, (m, d)) + 0.2).astype(np.float32)
    return x, y


def reference(
    x: np.ndarray, y: np.ndarray, eps: float = 0.05, steps: int = 10, block: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """The same iterations in float64, in blocks of rows and columns (JAX on the CPU)."""

    def lse_rows(pot: jax.Array, a: jax.Array, b: jax.Array, log_w: jax.Array) -> jax.Array:
        """``-eps * logsumexp_j((pot_j - |a_i - b_j|^2) / eps + log_w_j)`` per row block of a."""

        def one(ai: jax.Array) -> jax.Array:
            c = jnp.sum((ai[:, None, :] - b[None, :, :]) ** 2, -1)
            return -eps * jax.nn.logsumexp((pot[None, :] - c) / eps + log_w[None, :], axis=1)

        pad = -a.shape[0] % block
        blocks = jnp.pad(a, ((0, pad), (0, 0))).reshape(-1, block, a.shape[1])
        return jax.lax.map(one, blocks).reshape(-1)[: a.shape[0]]

    # on the CPU even where a GPU is the default device: XLA's GPU compile of these float64
    # reductions ran past 35 s on an H100 (jax 0.11.2), where the CPU's takes a second
    with jax.enable_x64(), jax.default_device(jax.devices("cpu")[0]):
        x64, y64 = jnp.asarray(x, jnp.float64), jnp.asarray(y, jnp.float64)
        n, m = x64.shape[0], y64.shape[0]
        log_a, log_b = -jnp.log(n) * jnp.ones(n), -jnp.log(m) * jnp.ones(m)

        @jax.jit
        def run(x64: jax.Array, y64: jax.Array) -> tuple[jax.Array, jax.Array]:
            def step(i: jax.Array, fg: tuple[jax.Array, jax.Array]) -> tuple:
                f = lse_rows(fg[1], x64, y64, log_b)
                return f, lse_rows(f, y64, x64, log_a)

            return jax.lax.fori_loop(0, steps, step, (jnp.zeros(n), jnp.zeros(m)))

        f, g = run(x64, y64)
        return np.asarray(f), np.asarray(g)


def max_error(got: tuple, want: tuple) -> float:
    """Largest absolute difference of the potentials (they are in units of the cost)."""
    return max(float(np.max(np.abs(np.asarray(a, np.float64) - b))) for a, b in zip(got, want))


def main() -> None:
    import memsafe

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=20_000)
    parser.add_argument("--m", type=int, default=20_000)
    parser.add_argument("--d", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--limit", default="64MiB")
    args = parser.parse_args()
    x, y = make_inputs(args.n, args.m, args.d)
    safe = memsafe.jit(sinkhorn, memory_limit=args.limit, static_argnums=3)
    start = time.perf_counter()
    f, g = safe(x, y, 0.05, args.steps)
    f.block_until_ready()
    print(safe.plan(x, y, 0.05, args.steps))
    print(f"memsafe: {time.perf_counter() - start:.2f} s (plan, compile and run)")
    print(f"transport cost (dual): {float(f.mean() + g.mean()):.6f}")


if __name__ == "__main__":
    main()
