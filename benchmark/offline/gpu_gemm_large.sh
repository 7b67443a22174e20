#!/usr/bin/env bash
# The decode GEMMs of a large model at 64-256 rows on one GPU, in one call of about five minutes: every
# projection of the Llama-3-8B shape, cuBLAS against the Triton GEMM (minisgl/kernel/gemm.py) over the
# tiles of FLOP-bound products (skinny_gemm.py --large: 128 or 256 rows, 128 or 256 columns, 1-4 splits),
# then cuBLAS against cuBLASLt (blas_choice.py), each layer its own weights, in CUDA graphs. Results go to
# $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 120 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py -k gemm 2>&1 | tail -2
timeout 330 python benchmark/offline/skinny_gemm.py --models llama3-8b --rows 64,128,192,256 --large \
    --sweep 128,192,256 --json "$OUT/gemm_large_llama3.json" 2>&1 | tee "$OUT/gemm_large_llama3.log"
timeout 120 python benchmark/offline/blas_choice.py --models llama3-8b --rows 128,192,256 \
    --json "$OUT/blas_choice_llama3.json" 2>&1 | tail -12
