#!/usr/bin/env bash
# The first token on one GPU, engine and server, with the prefill graphs at their default (2,048 tokens) and
# off, in one call of about seven minutes (carry ./.whl from benchmark/gpu_wheels.sh for the server):
#   - the CUDA engine tests with the engine's defaults (prefill graphs up to 2,048 tokens, the launcher);
#   - prefill_latency.py with transformers' generate beside it (--peer transformers), a fresh process;
#   - the server end to end (benchmark/online/bench.py): one client, 20 streamed requests one after another,
#     token-id prompts of U[100, 1024], 16 output tokens; the first is the first request after start.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 330 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_prefill_graph.py tests/test_gpu.py \
    tests/test_fp8_kv.py tests/test_gpu_sampling.py tests/test_launch.py 2>&1 | tee "$OUT/engine_tests.log" | tail -3
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
timeout 150 python benchmark/offline/prefill_latency.py --model /tmp/ckpt/qwen3-0.6b --lens 16,128,512,1024,2048 \
    --peer transformers --json "$OUT/first_token.json" 2>&1 | grep -E "start-up|prompt|request|Error"
for prefill in 2048 0; do
    echo "== server, --cuda-graph-max-prefill $prefill"
    timeout -s TERM -k 30 120 python benchmark/online/bench.py \
        --minisgl-args "--model /tmp/ckpt/qwen3-0.6b --cuda-graph-max-prefill $prefill" --prompt-ids \
        --min-len 100 --max-len 1024 --concurrency 1 --requests-per-level 20 --min-requests 20 --output-len 16 \
        --temperature 0.6 --json "$OUT/online_first_$prefill.jsonl" 2>&1 | grep -v "Warning\|return func" | tail -4
done
