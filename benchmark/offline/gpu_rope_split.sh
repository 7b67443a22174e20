#!/usr/bin/env bash
# The rotary kernel as three programs a token (q, k, v side by side) against one doing the three in turn, on
# one GPU in one call of about ten minutes: the rotary and CUDA engine tests, then the decode graph steps
# both ways with each cache (step_parts.py --drop rope-serial), then the upstream workload (bench.py
# --repeat 2) with each cache. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
timeout 200 python -m pytest -q -rfs -p no:cacheprovider tests/test_rotary_store.py tests/test_decode_rope.py \
    tests/test_triton_kernels.py -k "rot or rope" 2>&1 | tail -2
timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fp8_kv.py 2>&1 | tail -2
for kv in auto fp8_e4m3; do
    for part in none rope-serial; do
        timeout 140 python benchmark/offline/step_parts.py --model /tmp/ckpt/qwen3-0.6b --drop "$part" \
            --kv-cache-dtype "$kv" --json "$OUT/${kv}_$part.json" 2>&1 | tail -1 | cut -c1-100
    done
    python benchmark/offline/step_parts.py --compare "$OUT/${kv}_none.json" "$OUT/${kv}_rope-serial.json"
done
for kv in auto fp8_e4m3; do
    echo "== kv=$kv"
    timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
        --repeat 2 --kv-cache-dtype "$kv" 2>&1 | grep -E "ready in|minisgl" | tail -3
done
