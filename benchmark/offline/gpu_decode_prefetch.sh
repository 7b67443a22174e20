#!/usr/bin/env bash
# Decode attention with the next tile's rows asked for in registers, on one GPU in one call of about five
# minutes: decode_prefetch.py (variants against the engine's tiles, 64-256 requests, both pools), then the
# upstream workload with the FP8 cache on the engine's tiles and on the fastest FP8 variant (bench.py, a fresh
# process's first run each), and the decode kernel tests with the variant among the forced tiles.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
timeout 240 python benchmark/offline/decode_prefetch.py --json "$OUT/decode_prefetch.json" 2>&1 | grep -v Warn | tail -50
# the FP8 variant with the least time over the batches, as bench.py's --decode-tiles
best=$(python - "$OUT/decode_prefetch.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r["fp8"] and r["variant"] != "engine" and r["max_diff"] < 1e-2]
total = {}
for r in rows:
    total[r["variant"]] = total.get(r["variant"], 0.0) + r["us"]
name = min(total, key=total.get)
keys, warps, stages, regs = name.split()[1].split(",")
print(f"{keys},{warps},{stages},1,{regs},1")
PY
)
echo "fastest FP8 prefetch variant: $best"
for tiles in - "$best"; do
    extra=()
    [ "$tiles" != - ] && extra=(--decode-tiles "$tiles")
    echo "== kv=fp8 tiles=$tiles"
    timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
        --repeat 2 --kv-cache-dtype fp8_e4m3 "${extra[@]}" --json "$OUT/bench_fp8_${tiles//,/_}.json" 2>&1 \
        | grep -E "ready in|minisgl|Error" | tail -3
done
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_triton_kernels.py -k decode tests/test_decode_rope.py 2>&1 | tail -2
