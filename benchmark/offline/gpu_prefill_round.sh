#!/usr/bin/env bash
# Eager prefill steps' token counts rounded up (MINISGL_PREFILL_ROUND, engine/prefill_graph.py), one GPU, one call
# of about seven minutes: the host's time in a cuBLAS call at new and seen row counts (gemm_host.py); the CUDA
# engine tests; then, each in fresh processes alternating rounding off (0) and on (the default, 256): a burst of
# 256 short prompts (burst_profile.py --no-profile), single prompts of 2,500-2,800 and 4,000-4,300 tokens
# (prefill_latency.py --spread 300: eager steps, ten different counts a length) and the upstream workload (not with
# `quick`).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 90 python benchmark/offline/gemm_host.py --json "$OUT/gemm_host.json" 2>&1 | grep -v Warning
timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_prefill_graph.py tests/test_gpu.py 2>&1 |
    tee "$OUT/engine_tests.log" | tail -2
for round in 0 256 0 256; do
    echo "== MINISGL_PREFILL_ROUND=$round"
    MINISGL_PREFILL_ROUND=$round timeout 90 python benchmark/offline/burst_profile.py --model /tmp/ckpt/qwen3-0.6b \
        --rounds 5 --no-profile 2>&1 | grep "burst wall"
done
for round in 0 256; do
    MINISGL_PREFILL_ROUND=$round timeout 120 python benchmark/offline/prefill_latency.py --model /tmp/ckpt/qwen3-0.6b \
        --lens 2500,4000 --spread 300 --json "$OUT/prefill_latency_round$round.json" 2>&1 | grep "first token"
done
[ "${1:-all}" = quick ] && exit 0
for round in 0 256; do
    echo "== workload, MINISGL_PREFILL_ROUND=$round"
    MINISGL_PREFILL_ROUND=$round timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
        --device cuda --peer none --repeat 1 --json "$OUT/bench_round$round.json" 2>&1 | tail -1
done
