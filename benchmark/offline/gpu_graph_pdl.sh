#!/usr/bin/env bash
# Programmatic edges in the decode graphs (engine/graph_edges.py: MINISGL_GRAPH_PDL, MINISGL_PDL_KERNELS), on one
# GPU. Parts (the arguments; default all, more than one call's ten minutes: run `probe steps`, then `tests bench`
# with CUBLAS_WAITERS set to the regex the probe printed):
#   probe    graph_pdl.py: which of cuBLAS's kernels wait for their inputs on the device, a step's chain of
#            cuBLAS products with its edges programmatic, and the engine's decode-graph kernels by name
#   steps    the engine's decode graph steps (step_parts.py --drop none): as captured; edges into the cuBLAS
#            kernels the probe found waiting; into those and this project's kernels, which wait first (PDL 1);
#            the same, each of them also letting the next launch at once (PDL 2)
#   tests    the edges' GPU tests, and the CUDA engine tests with the last variant's edges
#   bench    the upstream workload, bf16, fresh processes alternating: as captured, then the last variant
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
parts=${*:-probe steps tests bench}
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
own=$(python -c "from minisgl.engine.graph_edges import OWN_WAITERS; print(OWN_WAITERS)")
# the cuBLAS kernels that wait: CUBLAS_WAITERS, else the probe's finding in this call
cublas() {
    [ -n "${CUBLAS_WAITERS:-}" ] && { echo "$CUBLAS_WAITERS"; return; }
    python -c "import json; print(json.load(open('$OUT/graph_pdl.json'))['probe']['waiters_regex'])" 2>/dev/null
}
both() { local c; c=$(cublas); echo "${c:+$c|}$own"; }
# variant NAME: sets MINISGL_GRAPH_PDL and MINISGL_PDL_KERNELS for it
variant() {
    case $1 in
    off) export MINISGL_GRAPH_PDL="" MINISGL_PDL_KERNELS=0 ;;
    cublas) export MINISGL_GRAPH_PDL="$(cublas)" MINISGL_PDL_KERNELS=0 ;;
    wait) export MINISGL_GRAPH_PDL="$(both)" MINISGL_PDL_KERNELS=1 ;;
    trigger) export MINISGL_GRAPH_PDL="$(both)" MINISGL_PDL_KERNELS=2 ;;
    esac
}
for part in $parts; do
    case $part in
    probe)
        timeout 240 python benchmark/offline/graph_pdl.py --model /tmp/ckpt/qwen3-0.6b --json "$OUT/graph_pdl.json" \
            2>&1 | tail -70
        ;;
    steps)
        for v in off cublas wait trigger; do
            variant $v
            timeout 120 python benchmark/offline/step_parts.py --model /tmp/ckpt/qwen3-0.6b --drop none \
                --json "$OUT/steps_pdl_$v.json" 2>&1 | tail -1 | cut -c1-120
        done
        variant off
        python benchmark/offline/step_parts.py --compare "$OUT"/steps_pdl_{off,cublas,wait,trigger}.json
        ;;
    tests)
        variant trigger
        timeout 200 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_graph_edges.py tests/test_gpu.py \
            tests/test_cuda_decode.py 2>&1 | tee "$OUT/gpu_tests_pdl.log" | tail -4
        variant off
        ;;
    bench)
        i=0
        for v in off trigger off trigger; do
            variant $v
            i=$((i + 1))
            echo "== $v"
            timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
                --repeat 1 --json "$OUT/bench_pdl_${i}_$v.json" 2>&1 | grep -E "minisgl" | tail -1
        done
        variant off
        ;;
    *) echo "unknown part $part" ;;
    esac
done
