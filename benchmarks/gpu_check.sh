#!/usr/bin/env bash
# One prepared check for a GPU machine (jax with CUDA installed system-wide; nothing to install).
# Run from anywhere:  bash benchmarks/gpu_check.sh      (writes into $OUT when set)
#   1. kernel_bench.py: device checks vs the reference (NaN-poisoned pages), then decode/prefill
#      timings beside jax's paged_attention and the XLA path, with the copy bandwidth of the run.
#   2. the kernel tests compiled for the GPU (JAXINFER_KERNEL_INTERPRET=0, JAX_PLATFORMS=cuda: the
#      test suite defaults to the CPU).
# Budget: ~4 minutes in all (each step has its own timeout).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/gpu_check}"
mkdir -p "$OUT"
status=0

{ nvidia-smi --query-gpu=name,memory.total,clocks.max.memory --format=csv || true; } | tee "$OUT/gpu.txt"
python -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" \
  | tee -a "$OUT/gpu.txt"

echo "== kernel_bench (device checks, then decode/prefill timings)"
timeout 150 python benchmarks/kernel_bench.py --check --bench --budget-s 100 --out "$OUT" 2>&1 \
  | tee "$OUT/kernel_bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== kernel tests compiled for the GPU (JAXINFER_KERNEL_INTERPRET=0)"
if python -c "import pytest" 2>/dev/null; then
  timeout 90 env JAXINFER_KERNEL_INTERPRET=0 JAX_PLATFORMS=cuda python -m pytest -q -p no:cacheprovider --durations=5 \
    tests/kernels/test_ragged_paged_attention.py tests/kernels/test_kv_write.py 2>&1 \
    | tee "$OUT/pytest_kernels_gpu.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
  echo "pytest not installed here: skipped (kernel_bench --check covers the device correctness)"
fi

echo "gpu_check status=$status (outputs in $OUT)"
exit $status
