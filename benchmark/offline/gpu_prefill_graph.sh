#!/usr/bin/env bash
# Prefill steps from CUDA graphs (engine/prefill_graph.py), on one GPU, in two calls:
#   tests    tests/test_prefill_graph.py, the Triton kernel tests, the CUDA engine tests (graphs on, as by
#            default) and the launcher's tests;
#   measure  prefill_latency.py with --cuda-graph-max-prefill 0 (eager) and 512 in turn, a
#            fresh process each, three times each (first token at 16, 128, 512, 1024 prompt tokens, the
#            top-k/top-p decode rate, the start-up time); then the upstream workload through bench.py
#            with the defaults (its prefill steps are thousands of tokens: they stay eager).
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
if [ "${1:-measure}" = tests ]; then
    timeout 240 python -m pytest -q -rfs -p no:cacheprovider tests/test_prefill_graph.py tests/test_launch.py 2>&1 |
        tee "$OUT/prefill_graph_tests.log" | tail -3
    timeout 200 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py 2>&1 |
        tee "$OUT/kernel_tests.log" | tail -2
    timeout 300 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fp8_kv.py \
        tests/test_gpu_sampling.py 2>&1 | tee "$OUT/engine_tests.log" | tail -3
    exit 0
fi
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for i in 1 2 3; do
    for graphs in 0 512; do
        echo "== --cuda-graph-max-prefill $graphs ($i)"
        timeout 90 python benchmark/offline/prefill_latency.py --model /tmp/ckpt/qwen3-0.6b --lens 16,128,512,1024 \
            --cuda-graph-max-prefill $graphs --json "$OUT/latency_graphs${graphs}_$i.json" 2>&1 |
            grep -E "start-up|prompt|request|Error"
    done
done
echo "== bench, the engine's defaults"
timeout 90 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none --repeat 2 2>&1 | tail -2
