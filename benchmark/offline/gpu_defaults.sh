#!/usr/bin/env bash
# The engine's defaults on one GPU, in one short call: the graph, prefill-graph and engine GPU tests (MoE and mixed
# steps apart), then the upstream workload's first run on the Qwen3-0.6B shape with temperature only, with top-k 50 /
# top-p 0.9, and with the FP8 cache, each a fresh process. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 200 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_graph_edges.py tests/test_prefill_graph.py \
    tests/test_gpu.py -k "not moe and not mixed" 2>&1 | tee $OUT/gpu_tests_final.log | tail -3
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for a in "bf16" "topp --top-k 50 --top-p 0.9" "fp8 --kv-cache-dtype fp8_e4m3"; do
    set -- $a; name=$1; shift
    echo "== $name"
    timeout 90 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none --repeat 1 \
        --json $OUT/bench_final_$name.json "$@" 2>&1 | grep -E "minisgl" | tail -1
done
