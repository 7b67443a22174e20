#!/usr/bin/env bash
# The RMSNorm weights folded into the projections after them (MINISGL_FOLD_NORMS, on by default) against the
# norms as launches, on one GPU in one call of about ten minutes: the Triton kernel and CUDA engine tests,
# the decode graph steps both ways (step_parts.py), then the upstream workload both ways with each cache
# (bench.py --repeat 2). `tests` runs the tests only. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
timeout 240 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py tests/test_rotary_store.py \
    tests/test_decode_rope.py 2>&1 | tail -2
timeout 300 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fp8_kv.py \
    tests/test_gpu_sampling.py tests/test_prefill_graph.py 2>&1 | tail -2
[ "${1:-}" = tests ] && exit 0
for fold in 1 0; do
    MINISGL_FOLD_NORMS=$fold timeout 140 python benchmark/offline/step_parts.py --model /tmp/ckpt/qwen3-0.6b \
        --json "$OUT/fold$fold.json" 2>&1 | tail -1 | cut -c1-100
done
python benchmark/offline/step_parts.py --compare "$OUT/fold0.json" "$OUT/fold1.json"
for kv in auto fp8_e4m3; do
    for fold in 1 0; do
        echo "== kv=$kv fold=$fold"
        MINISGL_FOLD_NORMS=$fold timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
            --device cuda --peer none --repeat 2 --kv-cache-dtype "$kv" 2>&1 | grep -E "ready in|minisgl" | tail -3
    done
done
