#!/usr/bin/env bash
# Decode attention against where the KV pool's slots lie, on one GPU in one call of about eight minutes: the
# CUDA engine tests, kv_layout.py (slot layouts x token- or head-major pool x bf16 / FP8, the engine's kernel
# and a bare gather), and the upstream workload with KV pages of 1 and 16 slots, both caches (bench.py,
# a fresh process's first run each). Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fp8_kv.py \
        tests/test_prefill_graph.py tests/test_gpu_sampling.py tests/test_warmup.py 2>&1 | tail -3
fi
timeout 150 python benchmark/offline/kv_layout.py --batches 64,256 --json "$OUT/kv_layout.json" 2>&1 | tail -40
for kv in fp8_e4m3 auto; do
    for page in 1 16; do
        echo "== kv=$kv page=$page"
        timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
            --repeat 1 --kv-cache-dtype $kv --page-size $page --json "$OUT/bench_${kv}_p$page.json" 2>&1 \
            | grep -E "ready in|minisgl|Error" | tail -2
    done
done
