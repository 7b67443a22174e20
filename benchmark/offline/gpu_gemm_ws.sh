#!/usr/bin/env bash
# Decode products whose weight slice waits in shared memory (gemm_ws.py) against cuBLAS, on one Hopper GPU: each
# candidate checked against float32 sums, each product kind alone, and a step's chain plainly and programmatically.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
timeout 400 python benchmark/offline/gemm_ws.py --rows ${ROWS:-1,4,8,16,24,32,64} --json "$OUT/gemm_ws.json" 2>&1 |
    tee "$OUT/gemm_ws.txt" | grep -v "^check" ; grep -c " ok$" "$OUT/gemm_ws.txt"; grep FAILED "$OUT/gemm_ws.txt" | head
