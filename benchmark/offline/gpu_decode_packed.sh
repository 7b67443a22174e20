#!/usr/bin/env bash
# Decode attention with several KV heads a program (decode_packed.py) against the engine's kernel, and the
# host's cost of one Triton launch by path (launch_cost.py), one call of about eight minutes on one GPU:
#   - decode_packed.py --check: the packed kernel's outputs against torch, compiled for the GPU;
#   - the sweep at batch 64, 128, 256 on the Qwen3-0.6B shape (16 query heads over 8 KV heads), bf16 and
#     FP8 pools, graph replays, each configuration checked against the engine's output;
#   - the same at 128 and 256 on the Llama-3-8B shape (32 over 8);
#   - launch_cost.py.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 90 python benchmark/offline/decode_packed.py --check 2>&1 | tee "$OUT/packed_check.log" | tail -3
timeout 300 python benchmark/offline/decode_packed.py --batches 64,128,256 --json "$OUT/packed_qwen3.json" \
    2>&1 | grep -E "^best|engine" | cut -c1-260
timeout 150 python benchmark/offline/decode_packed.py --batches 128,256 --q-heads 32 --json "$OUT/packed_llama.json" \
    2>&1 | grep -E "^best|engine" | cut -c1-260
timeout 60 python benchmark/offline/launch_cost.py --json "$OUT/launch_cost.json" 2>&1 | tail -6
