#!/usr/bin/env bash
# The CUDA C++ decode kernel (minisgl/kernel/cuda) on one GPU in one call of about seven minutes: alone against
# the Triton kernel (decode_cuda.py: every variant, 2 and 4 query heads a KV head, batches 16-256, both pools);
# the upstream workload's first run with the engine's defaults (the kernel on), FP8 and bf16 pools; then the
# tests that run the engine with it (its own, the CUDA engine's, the FP8 cache's, the warm-up's).
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
timeout 150 python benchmark/offline/decode_cuda.py --batches 16,64,256 --groups 2,4 --json "$OUT/decode_cuda.json" \
    2>&1 | grep -A40 "^fastest"
for kv in fp8_e4m3 auto; do
    echo "== kv=$kv"
    timeout 120 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
        --repeat 2 --kv-cache-dtype $kv --json "$OUT/bench_$kv.json" 2>&1 | grep -E "ready in|minisgl|Error" | tail -3
done
timeout 280 python -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_decode.py tests/test_gpu.py \
    tests/test_fp8_kv.py tests/test_warmup.py 2>&1 | tee "$OUT/tests.log" | tail -8
