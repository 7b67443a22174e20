#!/usr/bin/env bash
# The upstream workload on the FP8 cache with the engine's defaults (decode attention by the CUDA C++ kernel)
# and with MINISGL_DECODE_CUDA=0 (the Triton kernel), each a fresh process's first run and a second, in one
# call of about three minutes on one GPU. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for cuda in 0 1 0 1; do
    echo "== MINISGL_DECODE_CUDA=$cuda"
    MINISGL_DECODE_CUDA=$cuda timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
        --device cuda --peer none --repeat 2 --kv-cache-dtype fp8_e4m3 --json "$OUT/bench_fp8_cuda${cuda}_$SECONDS.json" \
        2>&1 | grep -E "ready in|minisgl|Error" | tail -3
done
