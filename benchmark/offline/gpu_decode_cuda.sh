#!/usr/bin/env bash
# Decode attention in CUDA C++ (decode_cuda.py: NVRTC, the CUDA cores) against the engine's Triton kernel, on
# one GPU in one call of about two minutes: ptxas's report for the device's architecture, then every variant's
# output against Triton's and its time at 64-256 requests, both pools. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
major_minor=$(python -c "import torch; print('%d%d' % torch.cuda.get_device_capability())")
timeout 60 python benchmark/offline/decode_cuda.py --compile-only --arch "sm_$major_minor" 2>&1 \
    | grep -E "entry|Used|spill" | tail -40
timeout 200 python benchmark/offline/decode_cuda.py --json "$OUT/decode_cuda.json" 2>&1 | grep -v Warn | tail -40
