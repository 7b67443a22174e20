#!/usr/bin/env bash
# The decode kernel's unmasked full tiles on one GPU, in one call of about five minutes:
#   - the Triton kernels' tests and every CUDA engine test (greedy tokens, graphs, FP8, sampling);
#   - the roofline's decode steps at every captured batch size and the whole upstream workload, with the
#     bf16 cache then the FP8 cache (roofline.py --sections steps,e2e);
#   - bench.py's first run of a fresh process and a later one: temperature only, top-k/top-p, FP8 cache.
# Results go to $OUT (or ./out). Python packages the machine lacks are installed from ./.whl if present.
set -uo pipefail
source benchmark/gpu_env.sh
timeout 200 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py tests/test_rotary_store.py \
    2>&1 | tee "$OUT/kernel_tests.log" | tail -2
timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_fp8_kv.py tests/test_gpu.py \
    tests/test_gpu_sampling.py 2>&1 | tee "$OUT/engine_tests.log" | tail -2
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for kv in auto fp8_e4m3; do
    timeout 100 python benchmark/offline/roofline.py --model /tmp/ckpt/qwen3-0.6b --sections steps,e2e \
        --kv-cache-dtype $kv --json "$OUT/roofline_$kv.json" 2>&1 | grep -E "bs=(1|8|64|128|256):|prefill|e2e" |
        cut -c1-220
done
for extra in "" "--top-k 50 --top-p 0.9" "--kv-cache-dtype fp8_e4m3"; do
    # shellcheck disable=SC2086
    timeout 90 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none --repeat 2 \
        $extra 2>&1 | tail -2
done
