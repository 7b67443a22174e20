#!/usr/bin/env bash
# A fresh machine's first start-up on one GPU: NVRTC's time for each tensor-core decode module (the kernels with
# the rotary work inside double the bf16 and FP8 ones), then the upstream workload (bf16) in a process with empty
# kernel caches (Triton's and the cubins', as on a fresh machine) and again in one that finds them: `LLM()` ready
# (start-up, warm-up included) and the first run's tok/s; then the top-k / top-p and FP8 workloads with the caches warm.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
python - <<'PY' 2>&1 | tee "$OUT/nvrtc_tc_modules.txt"
import time
from minisgl.kernel.cuda import compile_cubin
from minisgl.kernel.cuda.decode import TC_BF16_VARIANTS, TC_VARIANTS, tc_program
for fp8, variants in ((False, TC_BF16_VARIANTS), (True, TC_VARIANTS)):
    for rope in (False, True):
        start = time.perf_counter()
        compile_cubin(tc_program(variants, (2,), fp8, rope), "sm_90")
        print(f"{'fp8' if fp8 else 'bf16'} {'rope' if rope else 'plain'}: {time.perf_counter() - start:.2f} s")
PY
caches=$(mktemp -d)
for run in cold warm; do
    echo "== $run caches"
    TRITON_CACHE_DIR=$caches/triton MINISGL_CACHE_DIR=$caches/minisgl timeout 240 python benchmark/offline/bench.py \
        --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none --repeat 2 --json "$OUT/cold_start_$run.json" 2>&1 |
        grep -E "ready in|minisgl \(" | tail -3
done
# the other two workloads of the targets, fresh processes with the caches warm
echo "== top-k 50, top-p 0.9"
TRITON_CACHE_DIR=$caches/triton MINISGL_CACHE_DIR=$caches/minisgl timeout 120 python benchmark/offline/bench.py \
    --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none --repeat 2 --top-k 50 --top-p 0.9 \
    --json "$OUT/cold_start_topp.json" 2>&1 | grep -E "ready in|minisgl \(" | tail -3
echo "== FP8 cache"
TRITON_CACHE_DIR=$caches/triton MINISGL_CACHE_DIR=$caches/minisgl timeout 120 python benchmark/offline/bench.py \
    --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none --repeat 2 --kv-cache-dtype fp8_e4m3 \
    --json "$OUT/cold_start_fp8.json" 2>&1 | grep -E "ready in|minisgl \(" | tail -3
