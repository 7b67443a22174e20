#!/usr/bin/env bash
# Where the upstream workload's wall time is on the device (trace_steps.py's timeline): busy in prefill and in
# decode steps, idle before, between and after them; the Qwen3-0.6B shape with the bf16 cache (temperature, then
# top-k 50 / top-p 0.9) and the FP8 cache, each a fresh process timing an untraced run and a traced one; then the
# scheduler's host time a decode step (host_steps.py, at 256 and at 16 requests) and its torch calls (host_ops.py,
# on the GPU, without and with the decode graph: pin_memory and the copies counted too). One call of about five
# minutes on one GPU; results go to $OUT.
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
run() {  # NAME [bench.py arguments...]
    local name=$1
    shift
    echo "== $name"
    timeout 150 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
        --trace "$OUT/trace_$name.json" --json "$OUT/bench_$name.json" "$@" 2>&1 |
        grep -E "ready in|minisgl|tracing|Error" | tail -4
    python benchmark/offline/trace_steps.py "$OUT/trace_$name.json" --json "$OUT/steps_$name.json"
    gzip -f "$OUT/trace_$name.json"
}
run bf16
run bf16_topp --top-k 50 --top-p 0.9
run fp8 --kv-cache-dtype fp8_e4m3
echo "== host time a decode step"
timeout 150 python benchmark/offline/host_steps.py --model /tmp/ckpt/qwen3-0.6b --requests 256 --max-tokens 64 \
    --out "$OUT/host_steps" 2>&1 | grep -v "^\[" | head -11
timeout 120 python benchmark/offline/host_steps.py --model /tmp/ckpt/qwen3-0.6b --requests 16 --max-tokens 128 \
    --out "$OUT/host_steps_16" 2>&1 | grep -v "^\[" | head -11
echo "== host calls a decode step"
timeout 120 python benchmark/offline/host_ops.py --requests 16 --json "$OUT/host_ops_16.json" 2>&1 | grep -v "^\[" | head -40
timeout 120 python benchmark/offline/host_ops.py --requests 16 --graphs --json "$OUT/host_ops_16_graphs.json" 2>&1 |
    grep -v "^\[" | head -40
