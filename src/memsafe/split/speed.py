"""The planner's speed constants, per backend, each measured.

The memory limit bounds a chunk; two choices below that bound are for speed alone, and their best
values differ between a CPU, where chunks that stay near the caches run fastest, and a GPU, where
each loop iteration costs a few microseconds of launches, so fewer and longer iterations pay.
``tools/gpu_tuning.py`` measures both on a device; ``benchmarks/results/gpu/SUMMARY.md`` holds
the GPU numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

from memsafe import _jax

MiB = 2**20


@dataclass(frozen=True)
class Speed:
    """Speed constants of one backend.

    Attributes:
        chunk_bytes: modelled bytes per chunk above which a memory-bound region's chunk is
            lowered (:func:`memsafe.split.size.speed_cap`).
        tile_bytes: bytes of one tile of a tiled ``top_k`` selection's operand
            (:mod:`memsafe.split.strategies.selection`).
    """

    chunk_bytes: int
    tile_bytes: int


#: On a CPU (2 cores, jax 0.10.2, YNNPACK off):
#: - chunk_bytes: the Gaussian-kernel matvec at n=m=100k (1 GiB budget, one process, 3
#:   interleaved runs) took 4.10 s at 32 MiB (20-row chunks), 4.30 s at 64 MiB, 4.62 s at 128 MiB,
#:   4.86 s at 256 MiB, 5.01 s at 640 MiB and 4.57 s at 16 MiB; lax.map in batches of 256 took
#:   4.87 s;
#: - tile_bytes: the first pass of a 10,000 x 131,072 x 64 L2 kNN by tile width: 256 positions
#:   (10 MiB) 1.20 s, 512 1.25 s, 1,024 1.34 s.
CPU = Speed(chunk_bytes=32 * MiB, tile_bytes=10 * MiB)

#: On an NVIDIA H100 (jax 0.11.2, CUDA 13; 1 GiB limit; three rounds of interleaved calls):
#: - chunk_bytes: the Gaussian-kernel matvec at n=m=1M (d=3) took 5.10 s at 32 MiB (2-row
#:   chunks), 3.85 s at 64 MiB, 3.01-3.03 s at 128 MiB (8 rows), 5.28 s at 256 MiB, 4.43 s at
#:   512 MiB and 4.01 s uncapped (64 rows), against 3.74-3.82 s for lax.map in batches of 256; at
#:   n=m=100k: 0.048, 0.034, 0.026, 0.045, 0.041 and 0.038 s, lax.map 0.042-0.043 s;
#: - tile_bytes: the 10,000 x 1M x 64 L2 kNN (k=10) took 0.064 s with tiles of 10 MiB, 0.052 s
#:   at 40 MiB, 0.044 s at 160 MiB, 0.041 s at 640 MiB and at 2,560 MiB (both then bounded by the
#:   chunk: footprint 689 MiB), against 0.071 s with its chunks stored.
GPU = Speed(chunk_bytes=128 * MiB, tile_bytes=640 * MiB)

#: Each platform JAX lowers for; ROCm takes the GPU's values (not measured there) and any other
#: platform the CPU's, the smaller chunks.
BY_PLATFORM: dict[str, Speed] = {"cpu": CPU, "cuda": GPU, "rocm": GPU}


def current() -> Speed:
    """The speed constants of the default backend (the one memsafe plans and compiles for)."""
    return BY_PLATFORM.get(_jax.lowering_platform(), CPU)
