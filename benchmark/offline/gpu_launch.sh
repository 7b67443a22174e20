#!/usr/bin/env bash
# The Triton kernels launched through minisgl's launcher (kernel/launch.py), on one GPU, in two calls:
#   tests    with MINISGL_DIRECT_LAUNCH=1: tests/test_launch.py, the Triton kernel tests and the CUDA
#            engine tests; then launch_cost.py (host time a launch by path);
#   measure  MINISGL_DIRECT_LAUNCH=0 and =1 in turn, a fresh process each, three times each:
#            prefill_latency.py (one request: first token at 16, 128, 1024 prompt tokens; decode ms a
#            token); then the upstream workload through bench.py (a fresh process's first run and a
#            second), 1, 0, 1, 0. Alternating settings keeps a drift of the machine out of the comparison.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
if [ "${1:-measure}" = tests ]; then
    export MINISGL_DIRECT_LAUNCH=1
    timeout 60 python -m pytest -q -rfs -p no:cacheprovider tests/test_launch.py 2>&1 | tee "$OUT/launch_tests.log" | tail -2
    timeout 200 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py 2>&1 |
        tee "$OUT/kernel_tests.log" | tail -2
    timeout 300 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fp8_kv.py \
        tests/test_gpu_sampling.py 2>&1 | tee "$OUT/engine_tests.log" | tail -3
    timeout 60 python benchmark/offline/launch_cost.py --json "$OUT/launch_cost.json" 2>&1 | tail -8
    exit 0
fi
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for i in 1 2 3; do
    for direct in 0 1; do
        echo "== MINISGL_DIRECT_LAUNCH=$direct ($i)"
        MINISGL_DIRECT_LAUNCH=$direct timeout 90 python benchmark/offline/prefill_latency.py \
            --model /tmp/ckpt/qwen3-0.6b --json "$OUT/latency_direct${direct}_$i.json" 2>&1 | grep -E "prompt|request|Error"
    done
done
for direct in 1 0 1 0; do
    echo "== bench MINISGL_DIRECT_LAUNCH=$direct"
    MINISGL_DIRECT_LAUNCH=$direct timeout 90 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
        --device cuda --peer none --repeat 2 2>&1 | tail -2
done
