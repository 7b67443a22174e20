#!/usr/bin/env bash
# Products of few rows of our own (kernel/cuda/gemm.py, MINISGL_CUDA_GEMM_ROWS) and programmatic edges in the
# decode graphs of few rows (MINISGL_GRAPH_PDL=own, MINISGL_GRAPH_PDL_ROWS), on one Hopper GPU. Parts (the
# arguments; default all, more than one call's ten minutes: run `steps single tests`, then `llama peer bench`):
#   tests   the CUDA GEMM's and the edges' GPU tests
#   steps   the Qwen3-0.6B shape's decode graph steps of 1-64 rows (step_parts.py) in each variant below
#           ($STEP_VARIANTS, default base gemm gemm_pdl pdl)
#   single  one stream (512 prompt tokens, 512 new ones; $STREAMS streams), fresh processes alternating base
#           and gemm_pdl
#   llama   the Llama-3-8B shape's decode graph steps of 1-16 rows, base and gemm_pdl
#   peer    one stream by transformers (continuous batching, peer_cuda.py) beside minisgl's base and gemm_pdl
#   bench   the upstream workload, bf16, base then gemm_pdl in fresh processes (nothing should move)
# Variants: base (as the engine is), gemm (the CUDA GEMM up to 8 rows, edges as captured), gemm_edges (and the
# edges into it programmatic), gemm_pdl (and every kernel of the step waiting and letting the next launch,
# programmatic edges into all of them), pdl (the same edges without the CUDA GEMM). Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
parts=${*:-steps single tests llama peer bench}
qwen=/tmp/ckpt/qwen3-0.6b
[ -d $qwen ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b $qwen > /dev/null 2>&1
variant() {
    export MINISGL_GRAPH_PDL_ROWS=8
    case $1 in
    base) export MINISGL_CUDA_GEMM_ROWS=0 MINISGL_GRAPH_PDL="" MINISGL_PDL_KERNELS=0 ;;
    gemm) export MINISGL_CUDA_GEMM_ROWS=8 MINISGL_GRAPH_PDL="" MINISGL_PDL_KERNELS=0 ;;
    gemm_edges) export MINISGL_CUDA_GEMM_ROWS=8 MINISGL_GRAPH_PDL=own MINISGL_PDL_KERNELS=0 ;;
    gemm_pdl) export MINISGL_CUDA_GEMM_ROWS=8 MINISGL_GRAPH_PDL=own MINISGL_PDL_KERNELS=2 ;;
    pdl) export MINISGL_CUDA_GEMM_ROWS=0 MINISGL_GRAPH_PDL=own MINISGL_PDL_KERNELS=2 ;;
    esac
}
for part in $parts; do
    case $part in
    tests)
        timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_cuda_gemm.py \
            tests/test_graph_edges.py 2>&1 | tee "$OUT/gpu_tests_few_rows.log" | tail -4
        ;;
    steps)
        for v in ${STEP_VARIANTS:-base gemm gemm_pdl pdl}; do
            variant $v
            timeout 100 python benchmark/offline/step_parts.py --model $qwen --drop none --graph-bs ${STEP_BS:-1,2,4,8,16,64} \
                --json "$OUT/steps_few_rows_$v.json" 2>&1 | grep -E "Error|error" | tail -3
        done
        python benchmark/offline/step_parts.py --compare $(for v in ${STEP_VARIANTS:-base gemm gemm_pdl pdl}; do
            echo "$OUT/steps_few_rows_$v.json"; done)
        ;;
    single)
        for n in ${STREAMS:-1}; do
            for v in base gemm_pdl base gemm_pdl; do
                variant $v
                echo "== $n streams, $v"
                timeout 60 python benchmark/offline/bench.py --model $qwen --device cuda --peer none --repeat 2 \
                    --num-requests $n --min-len 512 --max-len 512 --json "$OUT/single_${n}_$v.json" 2>&1 |
                    grep -E "minisgl" | tail -2
            done
        done
        ;;
    llama)
        [ -d /tmp/ckpt/llama3-8b ] || python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b \
            > /dev/null 2>&1
        for v in base gemm_pdl; do
            variant $v
            timeout 150 python benchmark/offline/step_parts.py --model /tmp/ckpt/llama3-8b --drop none \
                --graph-bs ${STEP_BS:-1,2,4,8,16} --json "$OUT/steps_few_rows_llama_$v.json" 2>&1 | grep -E "Error|error" | tail -3
        done
        python benchmark/offline/step_parts.py --compare "$OUT"/steps_few_rows_llama_{base,gemm_pdl}.json
        ;;
    peer)
        variant base
        echo "== 1 stream, base, with the peer"
        timeout 150 python benchmark/offline/bench.py --model $qwen --device cuda --repeat 2 --num-requests 1 \
            --min-len 512 --max-len 512 --json "$OUT/single_peer.json" 2>&1 | grep -E "minisgl|transformers" | tail -3
        variant gemm_pdl
        echo "== 1 stream, gemm_pdl"
        timeout 60 python benchmark/offline/bench.py --model $qwen --device cuda --peer none --repeat 2 \
            --num-requests 1 --min-len 512 --max-len 512 --json "$OUT/single_peer_gemm_pdl.json" 2>&1 |
            grep -E "minisgl" | tail -2
        ;;
    bench)
        i=0
        for v in base gemm_pdl; do
            variant $v
            i=$((i + 1))
            echo "== $v"
            timeout 100 python benchmark/offline/bench.py --model $qwen --device cuda --peer none --repeat 1 \
                --json "$OUT/bench_few_rows_${i}_$v.json" 2>&1 | grep -E "minisgl" | tail -1
        done
        ;;
    *) echo "unknown part $part" ;;
    esac
done
