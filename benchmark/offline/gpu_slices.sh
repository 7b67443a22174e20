#!/usr/bin/env bash
# Products of few rows whose weight waits in shared memory (kernel/cuda/gemm.cu), on one Hopper GPU. Parts (the
# arguments; default all):
#   tests   the CUDA GEMM's, the edges' and the engine's GPU tests
#   steps   the Qwen3-0.6B shape's decode graph steps of 1-16 rows (step_parts.py) in each variant below
#           ($STEP_VARIANTS, default old new8 new16 new16p8)
#   single  streams of 512 prompt tokens and 512 new ones ($STREAMS, default 1 and 12), fresh processes
#           alternating old and $SINGLE_VARIANT (default new16)
# Variants (at commit 9e521ba, which added this script; MINISGL_GEMM_SLICES is gone after it): old (a checkout
# of the tree before, in ./old, with its defaults); new8, new16 (every product of up to 8 or 16 rows by the weight
# slices and the programmatic edges up to as many rows), new16p8 (the slices up to 16 rows, the edges up to 8);
# base (the engine as it was), hyb8, hyb16 (q|k|v and gate|up by the slices, o and down by the tiles, up to 8 or 16
# rows), tiles16 (the tiles and the edges up to 16 rows).
# ./old for the variant old: `mkdir old && git archive edaf995 minisgl benchmark | tar -x -C old`.
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
parts=${*:-tests steps single}
qwen=/tmp/ckpt/qwen3-0.6b
[ -d $qwen ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b $qwen > /dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
variant() {
    root=.
    case $1 in
    old) root=old; unset MINISGL_GEMM_SLICES MINISGL_CUDA_GEMM_ROWS MINISGL_GRAPH_PDL_ROWS MINISGL_PDL_KERNELS ;;
    new8) export MINISGL_GEMM_SLICES=2 MINISGL_CUDA_GEMM_ROWS=8 MINISGL_GRAPH_PDL_ROWS=8 MINISGL_PDL_KERNELS=2 ;;
    new16) export MINISGL_GEMM_SLICES=2 MINISGL_CUDA_GEMM_ROWS=16 MINISGL_GRAPH_PDL_ROWS=16 MINISGL_PDL_KERNELS=2 ;;
    new16p8) export MINISGL_GEMM_SLICES=2 MINISGL_CUDA_GEMM_ROWS=16 MINISGL_GRAPH_PDL_ROWS=8 MINISGL_PDL_KERNELS=2 ;;
    base) export MINISGL_GEMM_SLICES=0 MINISGL_CUDA_GEMM_ROWS=8 MINISGL_GRAPH_PDL_ROWS=8 MINISGL_PDL_KERNELS=2 ;;
    hyb8) export MINISGL_GEMM_SLICES=1 MINISGL_CUDA_GEMM_ROWS=8 MINISGL_GRAPH_PDL_ROWS=8 MINISGL_PDL_KERNELS=2 ;;
    hyb16) export MINISGL_GEMM_SLICES=1 MINISGL_CUDA_GEMM_ROWS=16 MINISGL_GRAPH_PDL_ROWS=16 MINISGL_PDL_KERNELS=2 ;;
    tiles16) export MINISGL_GEMM_SLICES=0 MINISGL_CUDA_GEMM_ROWS=16 MINISGL_GRAPH_PDL_ROWS=16 MINISGL_PDL_KERNELS=2 ;;
    esac
}
for part in $parts; do
    case $part in
    tests)
        timeout 400 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_cuda_gemm.py tests/test_graph_edges.py \
            tests/test_gpu.py -k "not moe and not mixed" 2>&1 | tee "$OUT/gpu_tests_slices.log" | tail -4
        ;;
    steps)
        for v in ${STEP_VARIANTS:-old new8 new16 new16p8}; do
            variant $v
            PYTHONPATH=$PWD/$root:$PYTHONPATH timeout 100 python $root/benchmark/offline/step_parts.py --model $qwen \
                --drop none --graph-bs ${STEP_BS:-1,2,4,8,12,16} --json "$OUT/steps_slices_$v.json" 2>&1 |
                grep -E "Error|error" | tail -3
        done
        python benchmark/offline/step_parts.py --compare $(for v in ${STEP_VARIANTS:-old new8 new16 new16p8}; do
            echo "$OUT/steps_slices_$v.json"; done)
        ;;
    single)
        for n in ${STREAMS:-1 12}; do
            for v in ${SINGLE_BASE:-old} ${SINGLE_VARIANT:-new16} ${SINGLE_BASE:-old} ${SINGLE_VARIANT:-new16}; do
                variant $v
                echo "== $n streams, $v"
                PYTHONPATH=$PWD/$root:$PYTHONPATH timeout 60 python $root/benchmark/offline/bench.py --model $qwen \
                    --device cuda --peer none --repeat 2 --num-requests $n --min-len 512 --max-len 512 \
                    --json "$OUT/single_slices_${n}_$v.json" 2>&1 | grep -E "minisgl" | tail -2
            done
        done
        ;;
    esac
done
