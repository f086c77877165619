"""Exact kNN with faiss-cpu's flat indexes (IndexFlatL2, IndexFlatIP for cosine, L1 flat)."""

from __future__ import annotations

import numpy as np


def _faiss():
    try:
        import faiss
    except ImportError as err:
        raise ImportError(
            "faiss peer needs the 'faiss-cpu' package (pip install faiss-cpu)"
        ) from err
    return faiss


def knn(x: np.ndarray, y: np.ndarray, k: int, metric: str = "l2") -> tuple[np.ndarray, np.ndarray]:
    """(distances, indices) of the k nearest rows of ``y`` for each row of ``x``, nearest first;
    squared L2 for 'l2', L1 for 'l1', 1 - cosine similarity for 'cosine'."""
    faiss = _faiss()
    x = np.ascontiguousarray(x, np.float32)
    y = np.ascontiguousarray(y, np.float32)
    d = x.shape[1]
    if metric in ("l2", "l2_expanded"):
        index = faiss.IndexFlatL2(d)
    elif metric == "l1":
        index = faiss.IndexFlat(d, faiss.METRIC_L1)
    elif metric == "cosine":
        index = faiss.IndexFlatIP(d)
        x = x / np.linalg.norm(x, axis=1, keepdims=True)
        y = y / np.linalg.norm(y, axis=1, keepdims=True)
    else:
        raise ValueError(f"faiss peer: unknown metric {metric!r}")
    index.add(y)
    dist, idx = index.search(x, k)
    if metric == "cosine":
        dist = 1.0 - dist
    return dist, idx
