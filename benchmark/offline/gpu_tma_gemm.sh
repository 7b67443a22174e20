#!/usr/bin/env bash
# Decode products through the tensor memory accelerator (tma_gemm.py) against cuBLAS on one Hopper GPU: every
# configuration checked against float32 sums, each product kind alone, a step's chain. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout ${LIMIT:-500} python benchmark/offline/tma_gemm.py --rows ${ROWS:-16,32,64,128,256} \
    --json "$OUT/tma_gemm.json" 2>&1 | tee "$OUT/tma_gemm.txt"
