#!/usr/bin/env bash
# The second prepared GPU check (after gpu_check.sh, the kernels): the engine end to end.
#   bash benchmarks/gpu_serving.sh         (writes into $OUT when set; ~5.5 minutes)
# The real SmolLM2 GGUF (98 MB) cannot travel to the device machine (64 MiB limit), so the model
# is SmolLM2-135M's shapes with random weights (configs/models/smollm2-135m-shapes: its config and
# tokenizer): with greedy decoding and ignore_eos every length is exact, so the compute is the
# real model's. Needs jax, flax, transformers, tokenizers, numpy and `gguf` (the model loader
# imports it; a GPU image without it takes the pure-Python wheel: `pip download --no-deps gguf`
# here, `pip install --no-index --no-deps gguf-*.whl` there). Run it after gpu_check.sh.
#   1. benchmarks/throughput.py: continuous vs static batching (both kinds), KV utilisation,
#      prefix-cache TTFT (128 requests, prompts 16-1024, outputs mean 128).
#   2. benchmarks/decode.py --no-llama: decode tokens/s at batch 1 and 64, contexts 32 and 512.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT="${OUT:-/tmp/gpu_serving}"
mkdir -p "$OUT"
MODEL=configs/models/smollm2-135m-shapes
status=0

echo "== throughput (continuous vs static, prefix cache)"
timeout 200 python benchmarks/throughput.py --model "$MODEL" --dummy --num-pages 8192 \
  --num-requests 128 --prefix-requests 32 2>&1 \
  | grep -v Warning | tee "$OUT/throughput.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== decode tokens/s"
timeout 130 python benchmarks/decode.py --model "$MODEL" --engine-arg load_format=dummy \
  --engine-arg tokenizer="$MODEL" --no-llama --batches 1,64 2>&1 \
  | grep -v Warning | tee "$OUT/decode.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "gpu_serving status=$status (outputs in $OUT)"
exit $status
