#!/usr/bin/env bash
# The decode GEMMs of 32-256 rows on one GPU, in one call of about five minutes: every projection of the
# Qwen3-0.6B and Llama-3-8B shapes, cuBLAS against the Triton GEMM (minisgl/kernel/gemm.py) over a sweep
# of tiles (rows 64-128, columns 64-128, K blocks 64-128, 1-8 splits, warps, stages), each layer its own
# weights, in CUDA graphs (skinny_gemm.py). Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 300 python benchmark/offline/skinny_gemm.py --models qwen3-0.6b --rows 32,64,128,256 \
    --sweep 32,64,128,256 --json "$OUT/gemm_wide_qwen3.json" 2>&1 | tee "$OUT/gemm_wide_qwen3.log"
timeout 240 python benchmark/offline/skinny_gemm.py --models llama3-8b --rows 64,256 --sweep 64,256 \
    --json "$OUT/gemm_wide_llama3.json" 2>&1 | tee "$OUT/gemm_wide_llama3.log"
