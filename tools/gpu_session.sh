#!/usr/bin/env bash
# One device call's GPU work, most needed first, each step under its own time limit so that a
# slow step leaves the next its share (see benchmarks/results/gpu/SUMMARY.md):
#   1. the mesh checks on the one GPU (kNN untuned, attention, training step): answers,
#      footprints, and the device's peak while planning;
#   2. the tiled top-k selection against the stored chunk (tools/gpu_selection.py);
#   3. the GPU benchmark cases not measured before.
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
# the kNN check first with the autotuner off: tuned, its compile ran past 220 s (H200)
timeout 210 python3 -m tools.gpu_checks --untuned --timeout 200 --out "$OUT/checks_untuned.json" knn
timeout 210 python3 -m tools.gpu_checks --timeout 150 --out "$OUT/checks.json" \
    attention train_step
timeout 90 python3 -m tools.gpu_selection >"$OUT/selection.json"
cat "$OUT/selection.json" | grep -v '^   *"  '
timeout 240 python3 -m benchmarks.run --size gpu --only knn,kernel_matvec,sgpr \
    --cases "l2 10k x 1M,l2 100k x 1M,n=m=1000000,3droad grad M=10000" \
    --methods memsafe,chunked_db,chunked --repeats 2 --timeout 120
uptime
tar czf "$OUT/results.tgz" benchmarks/results/gpu benchmarks/results/README.md
