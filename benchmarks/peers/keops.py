"""KeOps (pykeops) symbolic LazyTensors: kNN by argKmin and the Gaussian-kernel product."""

from __future__ import annotations

import numpy as np


def _lazy():
    try:
        from pykeops.numpy import LazyTensor
    except ImportError as err:
        raise ImportError("KeOps peer needs the 'pykeops' package (pip install pykeops)") from err
    return LazyTensor


def knn(x: np.ndarray, y: np.ndarray, k: int, metric: str = "l2") -> tuple[np.ndarray, np.ndarray]:
    """(distances, indices) by ``Kmin_argKmin`` over a symbolic distance matrix."""
    lazy = _lazy()
    x = np.ascontiguousarray(x, np.float32)
    y = np.ascontiguousarray(y, np.float32)
    if metric == "cosine":
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        y = y / np.linalg.norm(y, axis=1, keepdims=True)
    xi, yj = lazy(x[:, None, :]), lazy(y[None, :, :])
    if metric in ("l2", "l2_expanded"):
        dij = ((xi - yj) ** 2).sum(-1)
    elif metric == "l1":
        dij = (xi - yj).abs().sum(-1)
    elif metric == "cosine":
        dij = 1.0 - (xi | yj)
    else:
        raise ValueError(f"KeOps peer: unknown metric {metric!r}")
    dist, idx = dij.Kmin_argKmin(k, dim=1)
    return dist, idx


def gaussian_kernel_matvec(
    x: np.ndarray, y: np.ndarray, v: np.ndarray, lengthscale: float
) -> np.ndarray:
    """``exp(-|x_i - y_j|^2 / (2 l^2)) @ v`` as a KeOps sum reduction."""
    lazy = _lazy()
    x = np.ascontiguousarray(x, np.float32)
    y = np.ascontiguousarray(y, np.float32)
    v2 = np.ascontiguousarray(v.reshape(v.shape[0], -1), np.float32)
    dij = ((lazy(x[:, None, :]) - lazy(y[None, :, :])) ** 2).sum(-1)
    out = (-dij / np.float32(2 * lengthscale**2)).exp() @ v2
    return out.reshape((x.shape[0], *v.shape[1:]))


def sinkhorn(x: np.ndarray, y: np.ndarray, eps: float, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Log-domain Sinkhorn with each half-step a KeOps ``logsumexp`` reduction over a symbolic
    cost matrix (geomloss's scheme, without its annealing)."""
    lazy = _lazy()
    x = np.ascontiguousarray(x, np.float32)
    y = np.ascontiguousarray(y, np.float32)
    n, m = x.shape[0], y.shape[0]
    log_a = np.full((n, 1), -np.log(n), np.float32)
    log_b = np.full((m, 1), -np.log(m), np.float32)
    cxy = ((lazy(x[:, None, :]) - lazy(y[None, :, :])) ** 2).sum(-1)
    cyx = ((lazy(y[:, None, :]) - lazy(x[None, :, :])) ** 2).sum(-1)
    inv = np.float32(1 / eps)
    f, g = np.zeros((n, 1), np.float32), np.zeros((m, 1), np.float32)
    for _ in range(steps):
        gj = lazy((g * inv + log_b)[None, :, :])
        f = -eps * (gj - cxy * inv).logsumexp(dim=1)
        fj = lazy((f * inv + log_a)[None, :, :])
        g = -eps * (fj - cyx * inv).logsumexp(dim=1)
    return f.reshape(n), g.reshape(m)
