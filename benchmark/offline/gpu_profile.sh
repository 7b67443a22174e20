#!/usr/bin/env bash
# Where the GPU time of the upstream workload goes, in one call of under ten minutes on one GPU:
#   - the Triton kernels' tests and the fused rotary store's (FP8 bytes included);
#   - a kernel-by-kernel profile of one prefill step and one decode step at batch 256, bf16 cache then
#     FP8 cache (kernel_profile.py);
#   - the decode attention kernel alone at batch 256 (Qwen3-0.6B heads), bf16 and FP8 pools, every tile
#     configuration (roofline.py's attention section);
#   - the roofline's steps and the whole workload with the bf16 cache, the whole workload with the K/V
#     store apart (MINISGL_SEPARATE_KV_STORE=1, as before the rotary kernel stored K/V) and with FP8.
# Results go to $OUT (or ./out), one archive beside the printed summary.
set -uo pipefail
source benchmark/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 150 python -m pytest -q -rfs -p no:cacheprovider tests/test_rotary_store.py tests/test_triton_kernels.py \
    2>&1 | tee "$OUT/kernel_tests.log" | tail -2
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for kv in auto fp8_e4m3; do
    timeout 90 python benchmark/offline/kernel_profile.py --model /tmp/ckpt/qwen3-0.6b --kv-cache-dtype $kv \
        --json "$OUT/kernels_$kv.json" 2>&1 | grep -A14 "step, batch"
done
timeout 150 python benchmark/offline/roofline.py --model /tmp/ckpt/qwen3-0.6b --sections attention \
    --attention-batches 256 --json "$OUT/attention.json" 2>&1 | grep "decode attention"
timeout 100 python benchmark/offline/roofline.py --model /tmp/ckpt/qwen3-0.6b --sections steps,e2e \
    --json "$OUT/roofline.json" 2>&1 | grep -E "bs=(1|64|256):|prefill|e2e"
MINISGL_SEPARATE_KV_STORE=1 timeout 60 python benchmark/offline/roofline.py --model /tmp/ckpt/qwen3-0.6b \
    --sections e2e --json "$OUT/roofline_separate.json" 2>&1 | grep e2e
timeout 60 python benchmark/offline/roofline.py --model /tmp/ckpt/qwen3-0.6b --sections e2e \
    --kv-cache-dtype fp8_e4m3 --json "$OUT/roofline_fp8.json" 2>&1 | grep e2e
