#!/usr/bin/env bash
# One call of about nine minutes on one GPU: the fused gate|up GEMM (gpu_gate_up.sh: its tests, the CUDA
# engine tests with it on and the rotary inside decode at its default of up to 16 rows, decode steps and
# the workload off then on), the rotary-inside-decode kernel tests, and the decode GEMMs of 64 and 256
# rows against cuBLAS over a sweep of tiles (Qwen3-0.6B shapes). Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 110 python -m pytest -q -rfs -p no:cacheprovider tests/test_decode_rope.py 2>&1 | tee "$OUT/rope_tests.log" | tail -2
timeout 150 python benchmark/offline/skinny_gemm.py --models qwen3-0.6b --rows 64,256 --sweep 64,256 \
    --json "$OUT/gemm_wide_qwen3.json" 2>&1 | tee "$OUT/gemm_wide_qwen3.log"
bash benchmark/offline/gpu_gate_up.sh
