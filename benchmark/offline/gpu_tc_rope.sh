#!/usr/bin/env bash
# The rotary kernel's work inside the tensor-core decode kernel (decode_tc.cu's `_rope` kernels,
# MINISGL_TC_DECODE_ROPE: up to $ROPE_ROWS rows, default 128) on one Hopper GPU. Parts (the arguments; default all,
# more than one call's ten minutes: run `tests steps`, then `bench`):
#   tests   the `_rope` kernels against the rotary kernel then the plain kernel, the engine with them against the
#           rotary kernel's run and transformers, and the CUDA engine tests beside
#   steps   the Qwen3-0.6B shape's decode graph steps ($STEP_BS rows, step_parts.py), bf16 and FP8 cache, off / on
#   bench   the upstream workload, bf16 and FP8 cache, off then on, fresh processes' first runs
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
parts=${*:-tests steps bench}
qwen=/tmp/ckpt/qwen3-0.6b
[ -d $qwen ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b $qwen > /dev/null 2>&1
for part in $parts; do
    case $part in
    tests)
        timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_tc_decode_rope.py \
            tests/test_gpu.py -k "not moe and not mixed" 2>&1 | tee "$OUT/gpu_tests_tc_rope.log" | tail -4
        ;;
    steps)
        for kv in auto fp8_e4m3; do
            for on in 0 ${ROPE_ROWS:-128}; do
                MINISGL_TC_DECODE_ROPE=$on timeout 100 python benchmark/offline/step_parts.py --model $qwen --drop none \
                    --kv-cache-dtype $kv --graph-bs ${STEP_BS:-48,96,160,192} \
                    --json "$OUT/steps_tc_rope_${kv}_$on.json" 2>&1 | grep -E "Error|error" | tail -3
            done
            python benchmark/offline/step_parts.py --compare "$OUT"/steps_tc_rope_${kv}_{0,${ROPE_ROWS:-128}}.json
        done
        ;;
    bench)
        for round in ${ROUNDS:-1}; do
            for a in "bf16 auto" "fp8 fp8_e4m3"; do
                set -- $a
                for on in 0 ${ROPE_ROWS:-128}; do
                    echo "== $1, rope inside: $on, round $round"
                    MINISGL_TC_DECODE_ROPE=$on timeout 90 python benchmark/offline/bench.py --model $qwen --device cuda \
                        --peer none --repeat 1 --kv-cache-dtype $2 --json "$OUT/bench_tc_rope_${1}_${on}_$round.json" \
                        2>&1 | grep -E "minisgl" | tail -1
                done
            done
        done
        ;;
    esac
done
