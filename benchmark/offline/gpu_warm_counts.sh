#!/usr/bin/env bash
# The warm-up's products at the eager prefill counts (engine/warmup.py's _warm_products), on one GPU in one call:
#   tests   the CUDA engine, prefill-graph, warm-up and graph-edge tests
#   first   warm_counts.py: the first long prompt of each eager count, fresh processes alternating with the
#           products warmed at start and without
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
parts=${*:-tests first}
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for part in $parts; do
    case $part in
    tests)
        timeout 330 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_graph_edges.py tests/test_warmup.py \
            tests/test_prefill_graph.py tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -5
        ;;
    first)
        i=0
        for mode in on off on off; do
            i=$((i + 1))
            flag=()
            [ $mode = off ] && flag=(--no-warm)
            echo "== $mode"
            timeout 120 python benchmark/offline/warm_counts.py --model /tmp/ckpt/qwen3-0.6b "${flag[@]}" \
                --json "$OUT/warm_counts_${i}_$mode.json" 2>&1 | grep -E "first of|again|ready in"
        done
        ;;
    *) echo "unknown part $part" ;;
    esac
done
