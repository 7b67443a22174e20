#!/usr/bin/env bash
# Decode attention in CUDA C++ (decode_cuda.py: NVRTC, the CUDA cores) against the engine's Triton kernel, on
# one GPU in one call of about six minutes: ptxas's report for the device's architecture, every variant's output
# against Triton's and its time at 64-256 requests, both pools, then (if the outputs match) the upstream workload
# with the kernel in the engine (bench.py --decode-cuda, each pool's fastest variant against Triton).
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
major_minor=$(python -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")
timeout 60 python benchmark/offline/decode_cuda.py --compile-only --arch "sm_$major_minor" 2>&1 \
    | grep -E "entry|Used|spill" | tail -40
timeout 200 python benchmark/offline/decode_cuda.py --json "$OUT/decode_cuda.json" 2>&1 | grep -v Warn | tail -40
# the workload with the CUDA kernel in the engine (each pool's fastest variant over the batches), only if every
# output above matched Triton's
fastest() {  # POOL (fp8 or bf16): "U,LANES" of the variant with the least time over the batches and splits
    python - "$OUT/decode_cuda.json" "$1" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if "max_diff" in r]
if not rows or any(r["max_diff"] >= 2e-2 for r in rows):
    sys.exit(1)
total = {}
for r in rows:
    if r["fp8"] == (sys.argv[2] == "fp8"):
        total[r["kernel"]] = total.get(r["kernel"], 0.0) + r["us"]
print(min(total, key=total.get).split()[1])
PY
}
for pool in fp8 bf16; do
    if ! variant=$(fastest $pool); then
        echo "the CUDA kernel's outputs differ from Triton's (or it did not run): no workload run"
        break
    fi
    kv=$([ $pool = fp8 ] && echo fp8_e4m3 || echo auto)
    for v in - "$variant"; do
        extra=()
        [ "$v" != - ] && extra=(--decode-cuda "$v")
        echo "== kv=$kv decode-cuda=$v"
        timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
            --repeat 1 --kv-cache-dtype $kv "${extra[@]}" --json "$OUT/bench_${pool}_cuda${v//,/_}.json" 2>&1 \
            | grep -E "ready in|minisgl|Error" | tail -2
    done
done
