#!/usr/bin/env bash
# The FP8 decode kernel with its registers a thread capped (DecodeConfig.maxnreg), one call of about six
# minutes on one GPU:
#   - the Triton kernels' decode tests and the CUDA engine tests (FP8, graphs, sampling), with the engine's FP8 tiles capped;
#   - decode_splits.py --sweep regs: keys a tile x stages x register cap at batch 64, 128, 256 (graph replays);
#   - the upstream workload through bench.py: the FP8 cache as the engine now runs it, then with the cap
#     lifted (--decode-tiles 128,4,4,1,0: the kernel as it was), then the bf16 cache.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 200 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py -k "decode or fp8" \
    2>&1 | tee "$OUT/kernel_tests.log" | tail -2
timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_fp8_kv.py tests/test_gpu.py tests/test_gpu_sampling.py \
    2>&1 | tee "$OUT/engine_tests.log" | tail -2
timeout 200 python benchmark/offline/decode_splits.py --sweep regs --batches 64,128,256 \
    --json "$OUT/decode_regs.json" 2>&1 | grep -v Warning | tail -12
for run in "fp8_e4m3 -" "fp8_e4m3 128,4,4,1,0" "auto -"; do
    # shellcheck disable=SC2086
    bench_tiles $run
done
