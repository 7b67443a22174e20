#!/usr/bin/env bash
# The rotary inside decode attention at its default bound (MINISGL_FUSED_DECODE_ROPE=16) on one GPU, one
# call of about five minutes: its kernel tests (bf16 pools too), the upstream workload through bench.py
# (a fresh process's first run and a second) at the default and with the switch off, then the Llama-3-8B
# shape's workload at the default. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 170 python -m pytest -q -rfs -p no:cacheprovider tests/test_decode_rope.py 2>&1 | tee "$OUT/rope_tests.log" | tail -2
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for rows in 16 0; do
    MINISGL_FUSED_DECODE_ROPE=$rows timeout 90 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
        --device cuda --peer none --repeat 2 2>&1 | tail -2 | sed "s/^/rope<=$rows /"
done
timeout 60 python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b 2>&1 | tail -1
timeout 70 python benchmark/offline/bench.py --model /tmp/ckpt/llama3-8b --device cuda --peer none 2>&1 | tail -1
