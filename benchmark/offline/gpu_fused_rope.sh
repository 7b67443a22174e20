#!/usr/bin/env bash
# The rotary kernel inside decode attention at every batch (MINISGL_FUSED_DECODE_ROPE=1024 against 0) on
# one GPU, one call of about ten minutes (with 8b, past the limit of one call: run the 8b part alone):
#   - tests/test_decode_rope.py (bf16 pools too, on a GPU) and the CUDA engine tests with the switch on;
#   - the roofline's decode steps at every captured batch size, off then on, bf16 and FP8 caches;
#   - the upstream workload through bench.py (a fresh process's first run and a second), off then on;
#   - with `8b`, then the Llama-3-8B shape's workload (bf16 and FP8 caches), off then on (two minutes more).
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 150 python -m pytest -q -rfs -p no:cacheprovider tests/test_decode_rope.py 2>&1 | tee "$OUT/rope_tests.log" | tail -2
MINISGL_FUSED_DECODE_ROPE=1024 timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py \
    tests/test_fp8_kv.py tests/test_gpu_sampling.py 2>&1 | tee "$OUT/engine_tests.log" | tail -2
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for kv in auto fp8_e4m3; do
    for fused in 0 1024; do
        echo "== steps kv=$kv fused=$fused"
        MINISGL_FUSED_DECODE_ROPE=$fused timeout 100 python benchmark/offline/roofline.py --model /tmp/ckpt/qwen3-0.6b \
            --sections steps --kv-cache-dtype $kv --json "$OUT/steps_${kv}_fused$fused.json" 2>&1 |
            grep -E "bs=(1|8|32|64|128|256):" | cut -c1-90
    done
done
for kv in auto fp8_e4m3; do
    for fused in 0 1024; do
        echo "== bench kv=$kv fused=$fused"
        MINISGL_FUSED_DECODE_ROPE=$fused timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
            --device cuda --peer none --repeat 2 --kv-cache-dtype $kv 2>&1 | tail -2
    done
done
if [ "${1:-}" = 8b ]; then
    timeout 120 python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b 2>&1 | tail -1
    for kv in auto fp8_e4m3; do
        for fused in 0 1024; do
            echo "== 8b kv=$kv fused=$fused"
            MINISGL_FUSED_DECODE_ROPE=$fused timeout 150 python benchmark/offline/bench.py --model /tmp/ckpt/llama3-8b \
                --device cuda --peer none --kv-cache-dtype $kv 2>&1 | tail -1
        done
    done
fi
