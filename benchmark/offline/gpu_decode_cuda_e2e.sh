#!/usr/bin/env bash
# The upstream workload with Triton's decode attention and with decode_cuda.py's kernel (FP8 pool): three runs
# each and a traced fourth, and where the decode steps wait (trace_steps.py: host or device, by batch size);
# the bf16 pool's traced run beside them. One call of about three minutes on one GPU; results go to $OUT.
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
run() {  # NAME KV REPEAT MINISGL_DECODE_CUDA [bench.py arguments...]
    local name=$1 kv=$2 repeat=$3 cuda=$4
    shift 4
    echo "== $name"
    MINISGL_DECODE_CUDA=$cuda timeout 150 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
        --repeat "$repeat" --kv-cache-dtype "$kv" --trace "$OUT/trace_$name.json" "$@" \
        --json "$OUT/bench_$name.json" 2>&1 | grep -E "ready in|minisgl|tracing|Error" | tail -5
    python benchmark/offline/trace_steps.py "$OUT/trace_$name.json" --json "$OUT/steps_$name.json"
    gzip -f "$OUT/trace_$name.json"
}
run fp8_triton fp8_e4m3 3 0
run fp8_cuda fp8_e4m3 3 1
run bf16_triton auto 1 0
