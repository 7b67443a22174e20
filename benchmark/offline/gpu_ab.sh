#!/usr/bin/env bash
# This checkout against another tree of the project (BASE, default ./abbase: e.g. `mkdir abbase && git archive
# <commit> minisgl benchmark | tar -x -C abbase`) on one GPU, in one call of up to ten minutes. The parts to run
# are the arguments (default: tests steps bench):
#   tests     the rotary, decode-rope and linear_add tests and the CUDA engine tests, here only
#   steps     the decode graph steps of both trees (step_parts.py, Qwen3-0.6B shape) and their difference
#   bench     the upstream workload with both trees (bench.py --repeat 2), bf16 then FP8 cache, alternately
#   sampling  the workload with top_k 50 / top_p 0.9, both trees
#   llama     the workload on the Llama-3-8B shape, both trees
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
BASE=${BASE:-abbase}
out=$(cd "$OUT" && pwd)
parts=${*:-tests steps bench}
ckpt() { [ -d "/tmp/ckpt/$1" ] || python benchmark/offline/random_checkpoint.py "$1" "/tmp/ckpt/$1" > /dev/null 2>&1; }
# run TREE CMD...: CMD in TREE, its minisgl first on the path (the scripts put their own tree first too)
run() { (cd "$1" && shift && PYTHONPATH=$PWD:${PYTHONPATH#*:} "$@"); }
# workload MODEL ARGS...: bench.py --repeat 2 with this checkout, then with BASE
workload() {
    local model=$1
    shift
    for tree in . "$BASE"; do
        echo "== $model $* tree=$tree"
        run "$tree" timeout 150 python benchmark/offline/bench.py --model "/tmp/ckpt/$model" --device cuda \
            --peer none --repeat 2 "$@" 2>&1 | grep -E "ready in|minisgl" | tail -3
    done
}
ckpt qwen3-0.6b
for part in $parts; do
    case $part in
    tests)
        timeout 200 python -m pytest -q -rfs -p no:cacheprovider tests/test_linear_add.py tests/test_rotary_store.py \
            tests/test_decode_rope.py 2>&1 | tail -2
        timeout 200 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fp8_kv.py \
            tests/test_prefill_graph.py 2>&1 | tail -2
        ;;
    steps)
        for tree in "$BASE" .; do
            name=$([ "$tree" = . ] && echo new || echo base)
            run "$tree" timeout 140 python benchmark/offline/step_parts.py --model /tmp/ckpt/qwen3-0.6b \
                --json "$out/steps_$name.json" 2>&1 | tail -1 | cut -c1-100
        done
        python benchmark/offline/step_parts.py --compare "$out/steps_base.json" "$out/steps_new.json"
        ;;
    bench) for kv in auto fp8_e4m3; do workload qwen3-0.6b --kv-cache-dtype "$kv"; done ;;
    sampling) workload qwen3-0.6b --top-k 50 --top-p 0.9 ;;
    llama) ckpt llama3-8b && workload llama3-8b ;;
    *) echo "unknown part $part" ;;
    esac
done
