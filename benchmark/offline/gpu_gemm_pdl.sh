#!/usr/bin/env bash
# The decode GEMMs launched with programmatic dependent launch (MINISGL_GEMM_PDL, kernel/gemm.py) on one GPU, in
# one call of up to ten minutes. The parts to run are the arguments (default: tests steps):
#   tests   the split-K GEMM's kernel tests (the early-launch one among them) and the CUDA engine tests with
#           every projection on it (MINISGL_GEMM_PDL=2)
#   steps   the decode graph steps (step_parts.py, Qwen3-0.6B shape) with MINISGL_GEMM_PDL=0, 3, 1 and 2
#   bench   the upstream workload (bench.py --repeat 2) with MODES (default "0 1"), bf16 then FP8 cache
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
out=$(cd "$OUT" && pwd)
parts=${*:-tests steps}
ckpt=/tmp/ckpt/qwen3-0.6b
[ -d $ckpt ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b $ckpt > /dev/null 2>&1
for part in $parts; do
    case $part in
    tests)
        timeout 150 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py -k "skinny or silu" \
            2>&1 | tail -2
        MINISGL_GEMM_PDL=2 timeout 200 python -m pytest -q -rfs -x -p no:cacheprovider -m gpu tests/test_gpu.py \
            tests/test_fp8_kv.py 2>&1 | tail -2
        ;;
    steps)
        for mode in ${STEP_MODES:-0 3 1 2}; do
            MINISGL_GEMM_PDL=$mode timeout 130 python benchmark/offline/step_parts.py --model $ckpt \
                --json "$out/steps_pdl$mode.json" 2>&1 | tail -1 | cut -c1-100
        done
        python benchmark/offline/step_parts.py --compare "$out"/steps_pdl*.json
        ;;
    bench)
        for kv in auto fp8_e4m3; do
            for mode in ${MODES:-0 1}; do
                echo "== kv=$kv MINISGL_GEMM_PDL=$mode"
                MINISGL_GEMM_PDL=$mode timeout 120 python benchmark/offline/bench.py --model $ckpt --device cuda \
                    --peer none --repeat 2 --kv-cache-dtype $kv 2>&1 | grep -E "ready in|minisgl" | tail -3
            done
        done
        ;;
    *) echo "unknown part $part" ;;
    esac
done
