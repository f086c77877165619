#!/usr/bin/env bash
# One device call's GPU work, most needed first, each step under its own time limit so that a
# slow step leaves the next its share (see benchmarks/results/gpu/SUMMARY.md):
#   1. the one-GPU kNN check (issue 13), with memsafe's log of each compile: its refusal under
#      96 MiB no longer compiles an attempt beside the original (that compile ran past 190 s);
#   2. the shipped per-backend speed constants (memsafe.split.speed), measured with their
#      defaults: the kernel matvec at n=m=1M and the kNN at 10k x 1M, with the hand-chunked peers;
#   3. L1 and cosine kNN under memsafe on the GPU (not measured yet).
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
timeout 200 python3 -m tools.gpu_checks --verbose --timeout 190 --out "$OUT/checks_knn.json" knn
timeout 240 python3 -m benchmarks.run --size gpu --only knn,kernel_matvec \
    --cases "l2 10k x 1M,n=m=1000000,l1 100k x 100k,cosine 100k x 100k" \
    --methods memsafe,chunked_db,chunked --repeats 2 --timeout 100
uptime
