#!/usr/bin/env bash
# The tensor-core FP8 decode kernel (minisgl/kernel/cuda/decode_tc.cu) on one GPU in one call of about six
# minutes: its register report; each variant checked against a float64 reference (no timing if one is off),
# then against Triton's and the CUDA-core kernel's outputs and times at 16-256 requests, 2 and 4 query heads a
# KV head; Nsight Compute on each variant at 256 requests; the CUDA decode tests; then (unless the first
# argument is "kernels") the upstream workload with the FP8 cache, the CUDA-core kernel then the tensor cores
# (TC_VARIANT; fresh processes, first run and second). Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 60 python benchmark/offline/decode_tc.py --compile-only --arch "sm_$(python -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")"
timeout 150 python benchmark/offline/decode_tc.py --json "$OUT/decode_tc.json" 2>&1 | grep -v Warn | tail -40
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2> /dev/null | head -1)
timeout 120 "$NCU" --clock-control none -k "regex:decode_tc" --launch-skip 4 --launch-count 4 --section SpeedOfLight \
    --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables \
    python benchmark/offline/decode_ncu.py --tc > "$OUT/ncu_tc.txt" 2>&1
grep -E "  decode_tc|Duration|DRAM Throughput|Warp Cycles Per Issued|Block Limit (Reg|Shared)|Achieved Active Warps|bank" \
    "$OUT/ncu_tc.txt" | head -60
timeout 150 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_cuda_decode.py 2>&1 \
    | tee "$OUT/cuda_decode_tests.log" | tail -4
[ "${1:-}" = kernels ] && exit 0
python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for tc in 0 1; do
    echo "== FP8 cache, tensor cores=$tc"
    MINISGL_DECODE_TENSOR_CORES=$tc timeout 80 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
        --device cuda --peer none --repeat 2 --kv-cache-dtype fp8_e4m3 --json "$OUT/bench_fp8_tc$tc.json" 2>&1 | tail -2
done
