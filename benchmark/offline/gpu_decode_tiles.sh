#!/usr/bin/env bash
# The decode kernel's tile configurations and slot placements on one GPU, one call of about five minutes.
#   bash benchmark/offline/gpu_decode_tiles.sh tiles    # decode_variants.py --only tiles: keys a tile x
#       warps x stages x unmasked tiles at batch 64, 128 and 256, bf16
#       and FP8 pools, the five fastest of each, then the upstream workload through bench.py with the
#       engine's choice and with the configuration of least summed time, for each cache
#   bash benchmark/offline/gpu_decode_tiles.sh layout   # the Triton kernels' tests, decode_variants.py
#       --only layout (scattered slots, the engine's placement with pages of 1 and of 16), then the
#       upstream workload through bench.py with pages of 1 and 16, bf16 and FP8 caches
#   bash benchmark/offline/gpu_decode_tiles.sh vt       # the Triton kernels' tests, then decode_vt.py: the
#       decode kernel with V stored transposed within pages of 16 against the engine's, bf16 and FP8
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
mode=${1:-tiles}
[ "$mode" = tiles ] || timeout 240 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py tests/test_rotary_store.py \
    2>&1 | tee "$OUT/kernel_tests.log" | tail -4
if [ "$mode" = vt ]; then
    timeout 200 python benchmark/offline/decode_vt.py --batches 64,128,256 --json "$OUT/decode_vt.json" 2>&1 | tail -40
    exit 0
fi
if [ "$mode" = layout ]; then
    timeout 200 python benchmark/offline/decode_variants.py --only layout --batches 64,256 \
        --json "$OUT/decode_layout.json" > "$OUT/decode_layout.log" 2>&1
    tail -2 "$OUT/decode_layout.log"
    python - "$OUT/decode_layout.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    print(f"bs={r['bs']:3d} fp8={int(r['fp8'])} {r['placement']:14s} {r['config']:13s} "
          f"{r['us']:7.1f} us {r['tb_s']:5.2f} TB/s rel={r['rel_diff']:.4f}")
PY
    [ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
    for kv in auto fp8_e4m3; do
        for page in 1 16; do
            echo "== kv=$kv page=$page"
            timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
                --repeat 2 --kv-cache-dtype $kv --page-size $page 2>&1 | tail -2
        done
    done
    exit 0
fi
timeout 330 python benchmark/offline/decode_variants.py --only tiles --batches 64,128,256 \
    --json "$OUT/decode_tiles.json" > "$OUT/decode_tiles.log" 2>&1
tail -2 "$OUT/decode_tiles.log"
# the five fastest of each batch and pool, and the configuration with the least time summed over the
# batches for each pool, which bench.py then runs on the whole workload beside the engine's choice
python - "$OUT/decode_tiles.json" "$OUT/best_tiles.txt" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if r.get("variant") == "tiles" and "us" in r]
key = lambda r: (r["block_n"], r["warps"], r["stages"], int(r["even"]))
best = {}
for fp8 in (False, True):
    for bs in sorted({r["bs"] for r in rows}):
        group = [r for r in rows if r["bs"] == bs and r["fp8"] == fp8]
        chosen = [round(r["us"], 1) for r in group if r["chosen"]]
        print(f"bs={bs} fp8={fp8} chosen {chosen} us")
        for r in sorted(group, key=lambda r: r["us"])[:5]:
            print(f"    {key(r)} {r['us']:.1f} us {r['tb_s']:.2f} TB/s rel={r['rel_diff']:.4f}")
        for r in group:
            if r["rel_diff"] > 0.02:
                print("    BAD", r)
    sums = {}
    for r in rows:
        if r["fp8"] == fp8:
            sums.setdefault(key(r), []).append(r["us"])
    n = max(len(v) for v in sums.values())
    k = min((k for k in sums if len(sums[k]) == n), key=lambda k: sum(sums[k]))
    best[fp8] = ",".join(str(x) for x in k)
    print(f"fp8={fp8} least total: {best[fp8]} ({sum(sums[k]):.1f} us over {n} batches)")
open(sys.argv[2], "w").write(f"{best[False]} {best[True]}\n")
PY
read -r bf16_best fp8_best < "$OUT/best_tiles.txt"
for run in "auto -" "auto $bf16_best" "fp8_e4m3 -" "fp8_e4m3 $fp8_best"; do
    # shellcheck disable=SC2086
    bench_tiles $run
done
