#!/usr/bin/env bash
# The split-K Triton GEMM for decode steps (minisgl/kernel/gemm.py) on one GPU, in one call of about
# eight minutes. Results go to $OUT (or ./out):
#   - the Triton kernels' tests and every CUDA engine test, the kernel on;
#   - every decode GEMM shape of Qwen3-0.6B and Llama-3-8B against cuBLAS at 1-256 rows
#     (skinny_gemm.py, a tile sweep at 1, 4 and 16 rows);
#   - the decode graph at every captured batch size, the kernel off then on (roofline.py steps);
#   - the upstream workload, the kernel off then on, twice (bench.py).
# `gpu_gemm.sh quick` leaves out the GEMM shapes and runs the workload once each way.
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
timeout 120 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py 2>&1 |
    tee "$OUT/kernel_tests.log" | tail -2
timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_fp8_kv.py tests/test_gpu.py \
    tests/test_gpu_sampling.py 2>&1 | tee "$OUT/engine_tests.log" | tail -2
[ "${1:-}" = quick ] || timeout 150 python benchmark/offline/skinny_gemm.py --sweep 1,4,16 --json "$OUT/skinny_gemm.json" 2>&1 |
    tee "$OUT/skinny_gemm.log" | grep -v "^    "
for on in 0 1; do
    MINISGL_SKINNY_GEMM=$on timeout 100 python benchmark/offline/roofline.py --model /tmp/ckpt/qwen3-0.6b \
        --sections steps --json "$OUT/roofline_skinny$on.json" 2>&1 | grep -E "bs=(1|2|4|8|16|32|64|256):" |
        cut -c1-160 | sed "s/^/skinny=$on /"
done
runs="0 1 0 1"
[ "${1:-}" = quick ] && runs="0 1"
for on in $runs; do
    MINISGL_SKINNY_GEMM=$on timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
        --device cuda --peer none --repeat 2 2>&1 | grep -E "minisgl" | tail -2 | sed "s/^/skinny=$on /"
done
