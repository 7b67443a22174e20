#!/usr/bin/env bash
# The tensor-core FP8 decode kernel (decode_tc.cu, a candidate) on one GPU in one call of about three minutes:
# checked against a float64 reference (no timing if it is off), then against Triton's and the CUDA-core
# kernel's outputs and times at 16-256 requests, 2 and 4 query heads a KV head. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 60 python benchmark/offline/decode_tc.py --compile-only --arch "sm_$(python -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")"
timeout 240 python benchmark/offline/decode_tc.py --json "$OUT/decode_tc.json" 2>&1 | grep -v Warn | tail -40
