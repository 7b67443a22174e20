#!/usr/bin/env bash
# The tensor-core FP8 decode kernel (minisgl/kernel/cuda/decode_tc.cu) on one GPU in one call of about eight
# minutes. Parts (the arguments; default all):
#   kernels  its register report; each variant checked against a float64 reference (no timing if one is
#            off), then against Triton's and the CUDA-core kernel's outputs and times at 16-256 requests, 2 and
#            4 query heads a KV head (DECODE_TC_VARIANTS, DECODE_TC_LAYOUTS, DECODE_TC_POOL: decode_tc.py's
#            --variants, --layouts and --pool, default the engine's variants and slots, FP8)
#   ncu      Nsight Compute on each variant at 256 requests
#   tests    the CUDA decode and FP8 cache tests on the GPU
#   llama    the upstream workload on the Llama-3-8B shape (4 query heads a KV head) with the FP8 cache, the
#            tensor-core kernel then Triton's (fresh processes, first run and second)
#   qwen     the same on the Qwen3-0.6B shape (2 query heads a KV head; without: decode.cu's kernel)
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
parts=${*:-kernels tests llama qwen}
ckpt() { [ -d "/tmp/ckpt/$1" ] || python benchmark/offline/random_checkpoint.py "$1" "/tmp/ckpt/$1" > /dev/null 2>&1; }
# workload MODEL: bench.py --repeat 2 with the FP8 cache, the tensor cores on then off
workload() {
    ckpt "$1"
    for tc in 1 0; do
        echo "== $1 FP8 cache, tensor cores=$tc"
        MINISGL_DECODE_TENSOR_CORES=$tc timeout 150 python benchmark/offline/bench.py --model "/tmp/ckpt/$1" \
            --device cuda --peer none --repeat 2 --kv-cache-dtype fp8_e4m3 --json "$OUT/bench_$1_fp8_tc$tc.json" \
            2>&1 | grep -E "ready in|minisgl" | tail -3
    done
}
for part in $parts; do
    case $part in
    kernels)
        timeout 120 python benchmark/offline/decode_tc.py --compile-only --variants "${DECODE_TC_VARIANTS:-}" \
            --pool "${DECODE_TC_POOL:-fp8}" \
            --arch "sm_$(python -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")"
        timeout 300 python benchmark/offline/decode_tc.py --json "$OUT/decode_tc.json" \
            --variants "${DECODE_TC_VARIANTS:-}" --layouts "${DECODE_TC_LAYOUTS:-engine}" \
            --pool "${DECODE_TC_POOL:-fp8}" 2>&1 | grep -v Warn | tail -150
        ;;
    ncu)
        NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2> /dev/null | head -1)
        timeout 120 "$NCU" --clock-control none -k "regex:decode_tc" --launch-skip 2 --launch-count 2 \
            --section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
            --section MemoryWorkloadAnalysis_Tables python benchmark/offline/decode_ncu.py --tc > "$OUT/ncu_tc.txt" 2>&1
        grep -E "  decode_tc|Duration|DRAM Throughput|Warp Cycles Per Issued|Block Limit|Achieved Active Warps|bank" \
            "$OUT/ncu_tc.txt" | head -60
        ;;
    tests)
        timeout 200 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_cuda_decode.py tests/test_fp8_kv.py \
            2>&1 | tee "$OUT/gpu_tests.log" | tail -4
        ;;
    llama) workload llama3-8b ;;
    qwen) workload qwen3-0.6b ;;
    *) echo "unknown part $part" ;;
    esac
done
