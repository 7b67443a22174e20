#!/usr/bin/env bash
# Tensor parallelism and the GPU fast path on a 2-GPU machine, in one call: the tp=2 tests over NCCL,
# the GPU and Triton-kernel tests, a traced GPU run drawn as a timeline, then the upstream offline
# workload on a Llama-3-8B-shaped checkpoint at tp=1 and tp=2. Results go to $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
timeout 200 python -m pytest -q -rf -p no:cacheprovider --timeout 100 tests/test_tp.py -k "greedy or in_step" \
    2>&1 | tee "$OUT/tp_tests.log" | tail -6
timeout 260 python -m pytest -q -rf -p no:cacheprovider --timeout 120 tests/test_gpu.py tests/test_triton_kernels.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -12
python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
timeout 90 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
    --num-requests 64 --trace "$OUT/trace_gpu.json" 2>&1 | tail -1
timeout 60 python examples/plot_trace.py "$OUT/trace_gpu.json" -o "$OUT/trace_gpu.png" 2>&1 | tail -1
timeout 120 python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b 2>&1 | tail -1
for tp in 1 2; do
    timeout 150 python benchmark/offline/bench.py --model /tmp/ckpt/llama3-8b --device cuda --peer none \
        --tp-size $tp --json "$OUT/bench_llama3_8b_tp$tp.json" 2>&1 | tail -1
done
# the MoE: Qwen3-30B-A3B's shape (all 48 layers) at tp=2
timeout 240 python benchmark/offline/random_checkpoint.py qwen3-30b-a3b /tmp/ckpt/qwen3-30b-a3b 2>&1 | tail -1
timeout 240 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-30b-a3b --device cuda --peer none \
    --tp-size 2 --json "$OUT/bench_qwen3_30b_a3b_tp2.json" 2>&1 | tail -1
