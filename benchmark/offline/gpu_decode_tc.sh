#!/usr/bin/env bash
# The tensor-core FP8 decode kernel (minisgl/kernel/cuda/decode_tc.cu) on one GPU in one call of about eight
# minutes: its register report; checked against a float64 reference (no timing if it is off), then against
# Triton's and the CUDA-core kernel's outputs and times at 16-256 requests, 2 and 4 query heads a KV head; the
# CUDA decode tests (the engine with it beside transformers and the Triton kernel); the upstream workload
# with the FP8 cache, the CUDA-core kernel then the tensor cores (fresh processes, first run and second), and
# the bf16 cache beside; greedy agreement of the FP8 cache (tensor cores) with the bf16 one over 64 tokens.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 60 python benchmark/offline/decode_tc.py --compile-only --arch "sm_$(python -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")"
timeout 150 python benchmark/offline/decode_tc.py --json "$OUT/decode_tc.json" 2>&1 | grep -v Warn | tail -30
timeout 150 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_cuda_decode.py 2>&1 \
    | tee "$OUT/cuda_decode_tests.log" | tail -4
python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for case in "fp8_e4m3 0" "fp8_e4m3 1" "auto 0"; do
    set -- $case
    echo "== kv=$1 tensor cores=$2"
    MINISGL_DECODE_TENSOR_CORES=$2 timeout 80 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
        --device cuda --peer none --repeat 2 --kv-cache-dtype "$1" --json "$OUT/bench_${1}_tc$2.json" 2>&1 | tail -2
done
MINISGL_DECODE_TENSOR_CORES=1 timeout 100 python benchmark/offline/fp8_agreement.py --model /tmp/ckpt/qwen3-0.6b \
    --device cuda 2>&1 | tee "$OUT/fp8_agreement_tc.log" | tail -5
