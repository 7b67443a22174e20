#!/usr/bin/env bash
# Where the Llama-3-8B workload's time is, on one GPU in one call of about eight minutes: the read-only
# ceiling (read_rate.py) beside the copy, the decode GEMMs of 1-128 rows against it (skinny_gemm.py, with
# the split-K kernel's tiles swept at 1 and 16 rows), and the workload's GPU time split into prefill and
# decode steps (roofline.py's e2e section) for both model shapes. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
ckpt() { [ -d "/tmp/ckpt/$1" ] || python benchmark/offline/random_checkpoint.py "$1" "/tmp/ckpt/$1" > /dev/null 2>&1; }
timeout 120 python benchmark/offline/read_rate.py --json "$OUT/read_rate.json" 2>&1 | tail -25
timeout 200 python benchmark/offline/skinny_gemm.py --models llama3-8b --rows 1,4,16,32,64,128 --sweep 1,16 \
    --json "$OUT/skinny_llama3.json" 2>&1 | tail -30
ckpt qwen3-0.6b
timeout 100 python benchmark/offline/roofline.py --model /tmp/ckpt/qwen3-0.6b --sections e2e \
    --json "$OUT/e2e_qwen3.json" 2>&1 | grep -E "e2e|Error" | cut -c1-400
ckpt llama3-8b
timeout 150 python benchmark/offline/roofline.py --model /tmp/ckpt/llama3-8b --sections e2e \
    --json "$OUT/e2e_llama3.json" 2>&1 | grep -E "e2e|Error" | cut -c1-400
