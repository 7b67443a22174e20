#!/usr/bin/env bash
# The CUDA decode kernel (decode_cuda.py) inside the engine, kernel by kernel: the workload's decode steps at
# 256, 128, 64, 32 and 16 requests profiled with Triton's decode attention and with the CUDA kernel, both pools;
# and the kernel alone at the small batches. One call of about four minutes on one GPU; results go to $OUT.
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
timeout 120 python benchmark/offline/decode_cuda.py --batches 8,16,32 --groups 2 --json "$OUT/decode_cuda_small.json" \
    2>&1 | grep -E "triton|cuda 2,8|cuda 4,8"
for kv in fp8_e4m3 auto; do
    for v in 0 1; do
        echo "== kv=$kv MINISGL_DECODE_CUDA=$v"
        MINISGL_DECODE_CUDA=$v timeout 120 python benchmark/offline/kernel_profile.py --model /tmp/ckpt/qwen3-0.6b \
            --kv-cache-dtype $kv --decode-batches 128,64,32,16 --json "$OUT/profile_${kv}_cuda$v.json" 2>&1 \
            | grep -E -A4 "^decode step" | grep -v "^--"
    done
done
