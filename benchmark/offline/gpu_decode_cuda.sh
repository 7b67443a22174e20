#!/usr/bin/env bash
# Decode attention in CUDA C++ (decode_cuda.py: NVRTC, the CUDA cores) against the engine's Triton kernel, on
# one GPU in one call of about six minutes: ptxas's report for the device's architecture, every variant's output
# against Triton's and its time at 64-256 requests, both pools, then (if the outputs match) the upstream workload
# with the kernel in the engine (bench.py --decode-cuda 0/2/4, both caches). Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
major_minor=$(python -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")
timeout 60 python benchmark/offline/decode_cuda.py --compile-only --arch "sm_$major_minor" 2>&1 \
    | grep -E "entry|Used|spill" | tail -40
timeout 200 python benchmark/offline/decode_cuda.py --json "$OUT/decode_cuda.json" 2>&1 | grep -v Warn | tail -40
# the workload with the CUDA kernel in the engine, only if every output above matched Triton's
if python - "$OUT/decode_cuda.json" <<'PY'
import json, sys
rows = [r for r in json.load(open(sys.argv[1])) if "max_diff" in r]
sys.exit(0 if rows and all(r["max_diff"] < 2e-2 for r in rows) else 1)
PY
then
    for kv in fp8_e4m3 auto; do
        for u in 0 2 4; do
            echo "== kv=$kv decode-cuda=$u"
            timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
                --repeat 1 --kv-cache-dtype $kv --decode-cuda $u --json "$OUT/bench_${kv}_cuda$u.json" 2>&1 \
                | grep -E "ready in|minisgl|Error" | tail -2
        done
    done
else
    echo "the CUDA kernel's outputs differ from Triton's (or it did not run): no workload run"
fi
