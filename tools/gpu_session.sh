#!/usr/bin/env bash
# One device call's GPU work, most needed first, each step under its own time limit so that a
# slow step leaves the next its share (see benchmarks/results/gpu/SUMMARY.md):
#   0. issue 43, fused kernels side by side in one process (tools/gpu_fused.py, <= 4 minutes):
#      memsafe fused and chunked, jax.nn.dot_product_attention (cudnn, xla), Pallas mha,
#      hand-chunked JAX, jax.jit where it fits, KeOps where its wheels travel in .whl
#      (pip download --no-deps pykeops keopscore -d .whl; it also needs g++, the Python headers
#      and CUDA's nvrtc and headers on the device), the exp-throughput bound; -> $OUT/fused.json;
#   1. the one-GPU kNN check (issue 13; passed on 2026-11-27 once every compile ran without
#      XLA's fusion autotuner: planned in 9.7 s);
#   2. Sinkhorn: memsafe against jax.jit (20k) and hand-chunked JAX (20k, 100k); on 2026-11-27
#      only memsafe at 100k finished (the 20k cases' float64 reference, since moved to the CPU);
#   3. the kernel matvec and kNN rows again, now that the programs memsafe runs compile without
#      the fusion autotuner (its effect on kernel speed is not measured yet).
# Results land in $OUT (the device tool's folder; /tmp/gpu-out elsewhere). The device's image
# lacks the package graphviz: carry its wheel in .whl (pip download --no-deps graphviz -d .whl).
set -u
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD/src:$PWD:/tmp/site" PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:-/tmp/gpu-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
uptime
timeout 240 python3 -m tools.gpu_fused --budget 225 --out "$OUT/fused.json"
uptime
timeout 150 python3 -m tools.gpu_checks --verbose --timeout 140 --out "$OUT/checks_knn.json" knn
uptime
timeout 150 python3 -m benchmarks.run --size gpu --only sinkhorn \
    --methods jax,memsafe,chunked --repeats 2 --timeout 60
uptime
timeout 240 python3 -m benchmarks.run --size gpu --only kernel_matvec,knn \
    --cases "n=m=100000,n=m=1000000,l2 10k x 1M,l1 100k x 100k,cosine 100k x 100k" \
    --methods memsafe,chunked_db,chunked --repeats 2 --timeout 60
uptime
for f in sinkhorn kernel_matvec knn; do cp "benchmarks/results/gpu/$f.json" "$OUT/" 2>/dev/null; done
ls -la "$OUT"
