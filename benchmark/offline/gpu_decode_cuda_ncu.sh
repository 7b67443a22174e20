#!/usr/bin/env bash
# What bounds the CUDA C++ decode kernel (minisgl/kernel/cuda/decode.cu) at batch 256: Nsight Compute on one
# launch of each pool (decode_ncu.py --cuda), the Triton kernel's beside it; then the kernel's variants at 128-256
# requests (which one the bf16 pool should take above 64). One call of about four minutes on one GPU; results
# go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2> /dev/null | head -1)
sections=(--section SpeedOfLight --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis)
for kernel in triton cuda; do
    regex=$([ $kernel = cuda ] && echo "regex:^decode_" || echo "regex:_decode_kernel")
    flag=$([ $kernel = cuda ] && echo --cuda || true)
    echo "== $kernel"
    timeout 150 "$NCU" --clock-control none -k "$regex" --launch-skip 2 --launch-count 2 "${sections[@]}" \
        python benchmark/offline/decode_ncu.py $flag > "$OUT/ncu_$kernel.txt" 2>&1
    grep -E "decode|Duration|DRAM Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|No Eligible|Issued Warp|Stall" \
        "$OUT/ncu_$kernel.txt" | head -40
done
timeout 120 python benchmark/offline/decode_cuda.py --batches 128,192,256 --groups 2 --json "$OUT/decode_cuda_large.json" \
    2>&1 | grep -A12 "^fastest"
