#!/usr/bin/env bash
# Decode attention's splits along the sequence on one GPU, one call of about six minutes:
#   - decode_splits.py: every split count at batch 16-256 on the workload's uneven contexts, bf16 and FP8
#     pools, ten launches a CUDA graph (no launch time in the figures);
#   - the upstream workload through bench.py with the engine's split rule aiming at 264 programs (as it
#     is), 1,584 and 3,168 (--decode-programs), bf16 then FP8 cache.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 240 python benchmark/offline/decode_splits.py --json "$OUT/decode_splits.json" 2>&1 | grep -v Warning | tail -20
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for kv in auto fp8_e4m3; do
    for programs in 264 1584 3168; do
        echo "== kv=$kv programs=$programs"
        timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
            --repeat 2 --kv-cache-dtype $kv --decode-programs $programs 2>&1 | tail -2
    done
done
