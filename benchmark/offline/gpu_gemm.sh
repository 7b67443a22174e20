#!/usr/bin/env bash
# The split-K Triton GEMM for decode steps (minisgl/kernel/gemm.py) on one GPU. Results go to $OUT.
#   bash benchmark/offline/gpu_gemm.sh kernel   # kernel tests; every decode GEMM shape against cuBLAS
#                                               # (skinny_gemm.py, a tile sweep at 1, 16, 64, 256 rows);
#                                               # the upstream workload with it off and on (bench.py)
#   bash benchmark/offline/gpu_gemm.sh engine   # CUDA engine tests; graph steps and the workload with
#                                               # it off and on (roofline.py steps,e2e); top-p; FP8
set -uo pipefail
source benchmark/gpu_env.sh
mode=${1:-kernel}
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
bench() {  # $1: MINISGL_SKINNY_GEMM, then bench.py's extra arguments
    local on=$1
    shift
    MINISGL_SKINNY_GEMM=$on timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
        --device cuda --peer none --repeat 2 "$@" 2>&1 | grep -E "run [0-9]|minisgl" | tail -3 | sed "s/^/skinny=$on $* /"
}
if [ "$mode" = kernel ]; then
    timeout 200 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py 2>&1 |
        tee "$OUT/kernel_tests.log" | tail -2
    timeout 240 python benchmark/offline/skinny_gemm.py --sweep 1,16,64,256 --json "$OUT/skinny_gemm.json" 2>&1 |
        tee "$OUT/skinny_gemm.log" | grep -v "^    " 
    for on in 0 1 0 1; do bench $on; done
else
    timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_fp8_kv.py tests/test_gpu.py \
        tests/test_gpu_sampling.py 2>&1 | tee "$OUT/engine_tests.log" | tail -2
    for on in 0 1; do
        MINISGL_SKINNY_GEMM=$on timeout 100 python benchmark/offline/roofline.py --model /tmp/ckpt/qwen3-0.6b \
            --sections steps,e2e --json "$OUT/roofline_skinny$on.json" 2>&1 | grep -E "bs=(1|8|64|128|256):|e2e" |
            cut -c1-200 | sed "s/^/skinny=$on /"
    done
    for on in 0 1; do bench $on --top-k 50 --top-p 0.9; bench $on --kv-cache-dtype fp8_e4m3; done
fi
