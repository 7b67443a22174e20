#!/usr/bin/env bash
# Decode graphs captured in two parts (engine/decode_parts.py, MINISGL_DECODE_PARTS): one half of the batch's
# attention beside the other half's products, on one GPU. Parts (the arguments; default all):
#   tests   the GPU tests of the parts (greedy tokens against transformers, priorities on and off)
#   steps   the Qwen3-0.6B shape's decode graph steps ($STEP_BS, default 64,128,192,256) whole, in two parts
#           with attention at the lower priority, and in two parts at one priority ($KV: the cache, default auto)
#   bench   the upstream workload, bf16, whole then in parts, fresh processes alternating ($PARTS_FROM: the
#           smallest parted graph, default 64)
#   llama   the Llama-3-8B shape's decode graph steps, whole and in parts
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
parts=${*:-tests steps bench}
qwen=/tmp/ckpt/qwen3-0.6b
[ -d $qwen ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b $qwen > /dev/null 2>&1
from=${PARTS_FROM:-64}
variant() {
    case $1 in
    whole) export MINISGL_DECODE_PARTS=0 ;;
    parts) export MINISGL_DECODE_PARTS=$from MINISGL_DECODE_PARTS_PRIORITY=1 ;;
    flat) export MINISGL_DECODE_PARTS=$from MINISGL_DECODE_PARTS_PRIORITY=0 ;;
    esac
}
steps() {  # steps MODEL TAG
    for v in ${STEP_VARIANTS:-whole parts flat}; do
        variant $v
        timeout 200 python benchmark/offline/step_parts.py --model "$1" --drop none --kv-cache-dtype "${KV:-auto}" \
            --graph-bs ${STEP_BS:-64,128,192,256} --json "$OUT/steps_$2_$v.json" 2>&1 | grep -E "Error|error" | tail -3
    done
    python benchmark/offline/step_parts.py --compare $(for v in ${STEP_VARIANTS:-whole parts flat}; do
        echo "$OUT/steps_$2_$v.json"; done)
}
for part in $parts; do
    case $part in
    tests)
        timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py -k "two_parts" \
            tests/test_decode_parts.py 2>&1 | tee "$OUT/gpu_tests_decode_parts.log" | tail -4
        ;;
    steps) steps $qwen "qwen_${KV:-auto}" ;;
    bench)
        i=0
        for v in whole parts whole parts; do
            variant $v
            i=$((i + 1))
            echo "== $v"
            timeout 100 python benchmark/offline/bench.py --model $qwen --device cuda --peer none --repeat 1 \
                --kv-cache-dtype "${KV:-auto}" --json "$OUT/bench_parts_${i}_$v.json" 2>&1 | grep -E "minisgl" | tail -1
        done
        ;;
    llama)
        [ -d /tmp/ckpt/llama3-8b ] || python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b \
            > /dev/null 2>&1
        STEP_VARIANTS="whole parts" steps /tmp/ckpt/llama3-8b llama
        ;;
    *) echo "unknown part $part" ;;
    esac
done
