"""Seed 002's XLA memory experiments, as its author wrote them: pairs of a bad and a good form.

The inspector's findings (memsafe.inspect) and memsafe.jit's scheduling, recomputation and
constant passes are tested on these pairs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# -- fusion -----------------------------------------------------------------------------------


def kvec_mesh(n: int) -> jax.Array:
    return jnp.stack((jnp.arange(0, n), jnp.arange(0, n)), axis=-1)


def f_well_fused(x):
    """Everything fuses into one kernel."""
    a = x * 2
    b = jnp.arange(a.shape[0])[:, None] * 3
    c = x[0] + x - a
    return jnp.sin(a) + a**2 + b + c


def f_sum_jax(x):
    """A reduction that splits what could fuse (compare f_sum_explicit)."""
    kvm = kvec_mesh(len(x))
    return x * 2 + jnp.sum(kvm * x, axis=1, keepdims=True)


def f_sum_explicit(x):
    kvm = kvec_mesh(len(x))
    return x * 2 + (kvm[..., 0] * x[..., 0] + kvm[..., 1] * x[..., 1])[:, None]


# -- FFTs -------------------------------------------------------------------------------------


def f_fft3d(x):
    """(N, N, N, 2) layout: transposes around the FFT need an extra temporary."""
    a = jnp.fft.rfftn(x, axes=(0, 1, 2))
    b = jnp.fft.irfftn(a, axes=(0, 1, 2))
    return b


def f_fft3d_transposed(x):
    """(2, N, N, N) layout: no transposes."""
    a = jnp.fft.rfftn(x, axes=(1, 2, 3))
    b = jnp.fft.irfftn(a * 2, axes=(1, 2, 3))
    return b + 3


# -- loops ------------------------------------------------------------------------------------


def f_for(x, unroll=None):
    def add_x(i, x):
        return x * x + 1

    return jax.lax.fori_loop(0, 4, add_x, x, unroll=unroll)


# -- intermediates ----------------------------------------------------------------------------


def f_recalc(x):
    """XLA recomputes ``im`` after the reduction barrier instead of storing it."""
    im = jnp.exp(jnp.arange(x.size).reshape(x.shape) ** 2.3)
    a = x + jnp.sum(im, axis=-1, keepdims=True)
    return a + im


def f_stored(x):
    """With sin instead of exp, XLA stores ``im`` across the reduction barrier."""
    im = jnp.sin(jnp.arange(x.size).reshape(x.shape) ** 2.3)
    a = x + jnp.sum(im, axis=-1, keepdims=True)
    return a + im


# -- k-meshes and loops -----------------------------------------------------------------------


def myfftfreq(i, n, d=1.0):
    return jnp.where(i < (n + 1) // 2, i / n, (i - n) / n) / d


def myrfftfreq(i, n, d=1.0):
    return i / n / d


def get_kmesh(rho, d=1.0, norm2=False, real=True):
    ix, iy, iz = jnp.indices(
        (rho.shape[0], rho.shape[1], (rho.shape[2] // 2) + 1 if real else rho.shape[2])
    )
    kx = myfftfreq(ix, rho.shape[0], d=d)
    ky = myfftfreq(iy, rho.shape[1], d=d)
    kz = myrfftfreq(iz, rho.shape[2], d=d) if real else myfftfreq(iz, rho.shape[2], d=d)
    if norm2:
        return kx**2 + ky**2 + kz**2
    return jnp.stack((kx, ky, kz), axis=-1)


def f_filter_with_temp(rho):
    """k2 defined outside the loop is held as a temporary for the whole loop."""
    k2 = get_kmesh(rho, norm2=True)

    def step(i, rho):
        rhok = jnp.fft.rfftn(rho, axes=(0, 1, 2))
        rhok *= jnp.exp(-0.5 * k2)
        return jnp.fft.irfftn(rhok, axes=(0, 1, 2))

    return jax.lax.fori_loop(0, 5, step, rho)


def f_filter_with_recalc(rho):
    """k2 recomputed inside the loop body fuses into the filter kernel."""

    def step(i, rho):
        rhok = jnp.fft.rfftn(rho, axes=(0, 1, 2))
        rhok *= jnp.exp(-0.5 * get_kmesh(rho, norm2=True))
        return jnp.fft.irfftn(rhok, axes=(0, 1, 2))

    return jax.lax.fori_loop(0, 5, step, rho)


# -- constants --------------------------------------------------------------------------------


def f_numpy(x):
    """A NumPy constant: folded or passed as a hidden argument, slow to compile."""
    return x + np.arange(x.size).reshape(x.shape) ** 2.3


def f(x):
    return x + jnp.arange(x.size).reshape(x.shape) ** 2.3


# -- parallel branches ------------------------------------------------------------------------


def f_fft_multi(x, n=5):
    """n independent FFT chains: XLA may run them side by side, temps grow with n."""
    res = 0
    for i in range(n):
        res = res + jnp.fft.irfftn(
            (i + 2) * jnp.fft.rfftn(x + i, axes=(1, 2, 3)), axes=(1, 2, 3)
        ) ** (i + 2)
    return res


def f_fft_multi_for(x, n=5):
    def step(i, res):
        return res + jnp.fft.irfftn(
            (i + 2) * jnp.fft.rfftn(x + i + 1, axes=(1, 2, 3)), axes=(1, 2, 3)
        ) ** (i + 2)

    return jax.lax.fori_loop(0, n, step, jnp.zeros_like(x))


def f_fft_multi_barrier(x, n=5):
    res = 0
    for i in range(n):
        res = res + jnp.fft.irfftn(
            (i + 2) * jnp.fft.rfftn(x + i, axes=(1, 2, 3)), axes=(1, 2, 3)
        ) ** (i + 2)
        res, x = jax.lax.optimization_barrier((res, x))
    return res
