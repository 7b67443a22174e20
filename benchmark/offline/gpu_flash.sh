#!/usr/bin/env bash
# Prefill attention through cuDNN's flash kernel (kernel/flash.py, MINISGL_FLASH_PREFILL) on one GPU, one call of
# about eight minutes (`verify`: the GPU tests that cover prefill, then the workload A/B only):
#   - the flash path's tests and the engine's bf16 logits through it;
#   - extend_flash.py: one layer's prefill attention, the paged extend kernel against the flash path, its parts,
#     torch's own flash kernel and torch's SDPA, on long prompts, the workload's prefill step and a grid of new tokens x cached prefix;
#   - prefill_latency.py, a fresh process each: the first token at 1,024 to 32,768 prompt tokens, the flash path
#     off (MINISGL_FLASH_PREFILL=0) then on (the default);
#   - the upstream workload (bench.py, a fresh process's first run), off / on / off / on.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
workload() {  # NAME FLASH
    echo "== workload, MINISGL_FLASH_PREFILL=$2"
    MINISGL_FLASH_PREFILL=$2 timeout 120 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
        --device cuda --peer none --repeat 1 --json "$OUT/bench_$1.json" 2>&1 | grep -E "ready in|minisgl|Error" | tail -3
}
if [ "${1:-all}" = verify ]; then
    timeout 330 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_flash_prefill.py \
        tests/test_prefill_graph.py tests/test_gpu.py tests/test_fp8_kv.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -3
    for i in 1 2; do workload "off_$i" 0; workload "on_$i" 64; done
    exit 0
fi
timeout 150 python -m pytest -q -rfs -p no:cacheprovider tests/test_flash_prefill.py \
    "tests/test_gpu.py::test_bf16_logits_stay_close_to_transformers" 2>&1 | tee "$OUT/flash_tests.log" | tail -3
timeout 200 python benchmark/offline/extend_flash.py --json "$OUT/extend_flash.json" 2>&1 | grep -v Warning
for flash in 0 64; do
    echo "== prefill_latency, MINISGL_FLASH_PREFILL=$flash"
    MINISGL_FLASH_PREFILL=$flash timeout 120 python benchmark/offline/prefill_latency.py --model /tmp/ckpt/qwen3-0.6b \
        --lens 1024,4096,8192,32768 --json "$OUT/latency_flash_$flash.json" 2>&1 | grep -E "prompt|ready|Error"
done
for i in 1 2; do workload "off_$i" 0; workload "on_$i" 64; done
