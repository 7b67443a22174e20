#!/usr/bin/env bash
# The persistent MLP-half kernel (benchmark/offline/mlp_persistent.py) on one GPU: its test, then 28 layers of it
# against the engine's launches in CUDA graphs, by batch rows (ROWS; CONFIGS: the fused kernel's warps,stages,mode;
# ..., default the first table of docs/benchmarks.md's section). Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
out=$(cd "$OUT" && pwd)
# a grid barrier that never opens would hang: every step has a time limit
timeout 120 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py -k "persistent or skinny" 2>&1 | tail -2
timeout 300 python benchmark/offline/mlp_persistent.py --rows "${ROWS:-1,8,16,32,64}" --configs "${CONFIGS:-4,2,0}" \
    --json "$out/mlp_persistent.json"
