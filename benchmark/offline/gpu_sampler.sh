#!/usr/bin/env bash
# The temperature sampler's variants (sampler_variants.py), then the upstream workload with the engine as it
# is: temperature only, top-k 50 / top-p 0.9, and the FP8 cache, each a fresh process's first run and a
# second (bench.py --repeat 2), on one GPU in one call of about four minutes. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
timeout 120 python benchmark/offline/sampler_variants.py --json "$OUT/sampler_variants.json" 2>&1 | tail -4
[ "${1:-}" = variants ] && exit 0
run() {
    echo "== $*"
    timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
        --repeat 2 "$@" 2>&1 | grep -E "ready in|minisgl" | tail -3
}
run
run --top-k 50 --top-p 0.9
run --kv-cache-dtype fp8_e4m3
