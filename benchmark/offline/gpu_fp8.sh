#!/usr/bin/env bash
# The FP8 KV cache on one GPU, in one call of a few minutes:
#   - the Triton kernels' tests (FP8 store, decode and extend among them) and the CUDA test of
#     tests/test_fp8_kv.py (Triton with and without graphs against the torch backend's FP8 reads);
#   - the upstream offline workload on the Qwen3-0.6B shape, bf16 cache then FP8 cache, twice each
#     (the first run of a fresh machine pays Triton's compilation);
#   - greedy agreement of the two caches over the first 64 tokens, with the logit drift and margins.
# Results go to $OUT (or ./out). Python packages the machine lacks are installed from ./.whl if present.
set -uo pipefail
source benchmark/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py 2>&1 \
    | tee "$OUT/fp8_kernel_tests.log" | tail -4
timeout 120 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_fp8_kv.py 2>&1 \
    | tee "$OUT/fp8_engine_tests.log" | tail -4
python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for run in 1 2; do
    for kv in auto fp8_e4m3; do
        timeout 150 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
            --kv-cache-dtype "$kv" --json "$OUT/fp8_bench_${kv}_$run.json" 2>&1 | tail -1
    done
done
timeout 200 python benchmark/offline/fp8_agreement.py --model /tmp/ckpt/qwen3-0.6b --device cuda 2>&1 \
    | tee "$OUT/fp8_agreement.log" | tail -4
