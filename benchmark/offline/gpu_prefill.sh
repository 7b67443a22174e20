#!/usr/bin/env bash
# K/V stored by the rotary kernel on one GPU, in one call of a few minutes:
#   - the fused kernel's tests against the rotary then the store kernel, the Triton kernels' tests,
#     and every CUDA engine test (greedy tokens against transformers, graphs, page sizes, FP8, sampling
#     without host syncs, no compilation after the warm-up);
#   - launches per prefill and per decode step, counted eagerly, with the fusion off then on;
#   - the roofline's steps (decode graph replay, one 8x1024-token prefill) and the whole workload with
#     a CUDA event pair around every step, with MINISGL_SEPARATE_KV_STORE=1 (before) and without (after).
# `gpu_prefill.sh tests` or `gpu_prefill.sh measure` runs one half (each fits one 10-minute call).
# Results go to $OUT (or ./out). Python packages the machine lacks are installed from ./.whl if present.
set -uo pipefail
source benchmark/gpu_env.sh
STAGE=${1:-all}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [ "$STAGE" != measure ]; then
timeout 180 python -m pytest -q -rfs -p no:cacheprovider tests/test_rotary_store.py tests/test_triton_kernels.py \
    2>&1 | tee "$OUT/prefill_kernel_tests.log" | tail -4
# every CUDA engine test: the fused store beside the rest (sampling without host syncs, warm-up, FP8)
timeout 360 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_fp8_kv.py tests/test_gpu.py \
    tests/test_gpu_sampling.py 2>&1 | tee "$OUT/prefill_engine_tests.log" | tail -6
fi
[ "$STAGE" = tests ] && exit 0
python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for separate in 1 0; do
    MINISGL_SEPARATE_KV_STORE=$separate timeout 120 python benchmark/offline/launch_count.py \
        --model /tmp/ckpt/qwen3-0.6b --json "$OUT/launches_separate$separate.json" 2>&1 | grep launches
    MINISGL_SEPARATE_KV_STORE=$separate timeout 400 python benchmark/offline/roofline.py \
        --model /tmp/ckpt/qwen3-0.6b --sections steps,e2e --json "$OUT/roofline_separate$separate.json" 2>&1 \
        | grep -E "prefill|decode step|e2e" | tail -6
done
