#!/usr/bin/env bash
# One device call's GPU work, most needed first, each step under its own time limit so that a
# slow step leaves the next its share (see benchmarks/results/gpu/SUMMARY.md):
#   1. the speed constants per backend (tools/gpu_tuning.py): the speed cap of a memory-bound
#      chunk on the kernel matvec, the tile width of the tiled top-k selection on the kNN;
#   2. the kNN check on the one GPU, every compile untuned, with memsafe's log of each compile.
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
timeout 240 python3 -m tools.gpu_tuning --rounds 3 >"$OUT/tuning.json"
timeout 210 python3 -m tools.gpu_checks --untuned --verbose --timeout 200 \
    --out "$OUT/checks_untuned.json" knn
uptime
