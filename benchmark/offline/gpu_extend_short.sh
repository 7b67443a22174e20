#!/usr/bin/env bash
# Prefill attention's tiles for short prompts on one GPU (one call of about five minutes; `burst`: the burst A/B
# and the kernel tests only): extend_sweep.py --short on steps of prompts of 16-128 new tokens (fresh and after a cached
# prefix of 1,024) and the workload's prefill step; short_prompts.py, a burst of 256 prompts of 16-64 tokens with
# the short tiles and without; then the Triton extend/FP8 kernel tests and the CUDA engine tests. Results go to $OUT.
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
if [ "${1:-all}" != burst ]; then
    timeout 200 python benchmark/offline/extend_sweep.py --short \
        --cases q16_p0,q32_p0,q64_p0,q128_p0,q16_p1024,q64_p1024,workload --json "$OUT/extend_sweep_short.json" 2>&1 |
        grep -v Warning | tail -12
fi
timeout 120 python benchmark/offline/short_prompts.py --model /tmp/ckpt/qwen3-0.6b --json "$OUT/short_prompts.json" 2>&1 |
    grep -E "round|Error"
timeout 150 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py -k "extend or short or fp8" 2>&1 |
    tee "$OUT/kernel_tests.log" | tail -2
[ "${1:-all}" = burst ] && exit 0
timeout 200 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_prefill_graph.py tests/test_gpu.py 2>&1 |
    tee "$OUT/engine_tests.log" | tail -2
