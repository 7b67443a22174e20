#!/usr/bin/env bash
# One GPU, one call (about eight minutes): the CUDA engine tests (prefill graphs of 16-128 tokens capture the short
# prompts' extend tiles), the upstream workload's first run in a fresh process (bf16), and where a burst of 256 short
# prompts spends its time (burst_profile.py: the host's functions, the device's kernels). Results go to $OUT.
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_prefill_graph.py tests/test_gpu.py 2>&1 |
    tee "$OUT/engine_tests.log" | tail -2
timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none --repeat 1 \
    --json "$OUT/bench_bf16.json" 2>&1 | tail -2
timeout 150 python benchmark/offline/burst_profile.py --model /tmp/ckpt/qwen3-0.6b --json "$OUT/burst_profile.json" \
    2>&1 | grep -v Warning > "$OUT/burst_profile.txt"
head -c 9000 "$OUT/burst_profile.txt"
