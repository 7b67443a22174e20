#!/usr/bin/env bash
# Decode attention's programs longest context first (MINISGL_DECODE_LONGEST_FIRST, from 32 rows by default) on
# one GPU, in one call of about nine minutes. Results go to $OUT (or ./out). Parts (all by default):
#   tests     the Triton kernel tests and the CUDA engine tests, with the default
#   order     decode attention in batch order and longest first, 1-4 splits, both pools (decode_splits.py)
#   workload  the upstream workload, bf16 then FP8 cache, never ordered then the default (bench.py, a fresh
#             process's first run and a second), then the Llama-3-8B shape's workload with the default
set -uo pipefail
source benchmark/gpu_env.sh
parts=${1:-tests,workload}
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
if [[ $parts == *tests* ]]; then
    timeout 90 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py 2>&1 |
        tee "$OUT/kernel_tests.log" | tail -2
    timeout 200 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fp8_kv.py 2>&1 |
        tee "$OUT/engine_tests.log" | tail -2
fi
if [[ $parts == *order* ]]; then
    timeout 150 python benchmark/offline/decode_splits.py --sweep order --batches 16,32,64,96,128,192,256 \
        --json "$OUT/decode_order.json" 2>&1 | tee "$OUT/decode_order.log"
fi
if [[ $parts == *workload* ]]; then
    for kv in bfloat16 fp8_e4m3; do
        for from in 0 32; do
            MINISGL_DECODE_LONGEST_FIRST=$from timeout 90 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
                --device cuda --peer none --repeat 2 --kv-cache-dtype $kv 2>&1 | grep -E "minisgl" | tail -2 |
                sed "s/^/longest_first_from=$from /"
        done
    done
    timeout 60 python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b > /dev/null 2>&1
    timeout 80 python benchmark/offline/bench.py --model /tmp/ckpt/llama3-8b --device cuda --peer none 2>&1 |
        grep -E "minisgl" | tail -1 | sed "s/^/llama3-8b longest_first_from=32 /"
fi
