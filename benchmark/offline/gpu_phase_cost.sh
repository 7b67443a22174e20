#!/usr/bin/env bash
# What a decode step's weight reads cost as kernels and as phases of one persistent kernel, and the workloads
# beside, on one GPU. Parts (the arguments; default all):
#   phases   phase_cost.py: a Qwen3-0.6B step's 112 weight reads as kernels, as phases with barriers over the
#            grid, with the next phase asked for early, through a ring across the phases, and as one stream
#   gemmpdl  gemm_pdl.py: a step's chain of products by cuBLAS, by minisgl/kernel/cuda/gemm.cu plainly and programmatically
#   tests    the CUDA kernel and engine tests on the GPU
#   qwen     the upstream workload on the Qwen3-0.6B shape, bf16 cache, temperature then top-k 50 / top-p 0.9
#   llama    the same on the Llama-3-8B shape, temperature
# Results go to $OUT (or ./out). (gemm.cu is the decode GEMM of docs/benchmarks.md's "A decode GEMM on the tensor
# cores", made to read its weights before it waits; the engine takes it for few rows: "Products of few rows".)
set -uo pipefail
source benchmark/gpu_env.sh
parts=${*:-phases gemmpdl tests qwen llama}
ckpt() { [ -d "/tmp/ckpt/$1" ] || python benchmark/offline/random_checkpoint.py "$1" "/tmp/ckpt/$1" > /dev/null 2>&1; }
# run NAME MODEL ARGS...: bench.py --repeat 2 on a fresh process
run() {
    local name=$1 model=$2
    shift 2
    ckpt "$model"
    echo "== $name"
    timeout 200 python benchmark/offline/bench.py --model "/tmp/ckpt/$model" --device cuda --peer none --repeat 2 \
        --json "$OUT/bench_$name.json" "$@" 2>&1 | grep -E "ready in|minisgl" | tail -3
}
for part in $parts; do
    case $part in
    phases) timeout 120 python benchmark/offline/phase_cost.py --json "$OUT/phase_cost.json" 2>&1 | tail -24 ;;
    gemmpdl) timeout 200 python benchmark/offline/gemm_pdl.py --json "$OUT/gemm_pdl.json" 2>&1 | tail -8 ;;
    tests)
        timeout 300 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_cuda_decode.py tests/test_fp8_kv.py tests/test_gpu_sampling.py \
            tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -6
        ;;
    qwen)
        run qwen_bf16 qwen3-0.6b
        run qwen_bf16_topp qwen3-0.6b --top-k 50 --top-p 0.9
        ;;
    llama) run llama_bf16 llama3-8b ;;
    *) echo "unknown part $part" ;;
    esac
done
