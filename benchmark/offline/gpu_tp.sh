#!/usr/bin/env bash
# Tensor parallelism on a 2-GPU machine, in one call: the GPU tests (tp=2 among them), then the upstream
# offline workload on a Llama-3-8B-shaped checkpoint at tp=1 and tp=2. Results go to $OUT (or ./out).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
nvidia-smi --query-gpu=name,memory.total --format=csv
python -m pytest -q -p no:cacheprovider tests/test_gpu.py tests/test_triton_kernels.py \
    "tests/test_tp.py::test_greedy_tokens_at_tp2_equal_transformers" \
    "tests/test_tp.py::test_ranks_stay_in_step_through_sampling_aborts_and_stop_strings" \
    "tests/test_tp.py::test_a_killed_rank_fails_generate_and_leaves_no_process" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b
for tp in 1 2; do
    python benchmark/offline/bench.py --model /tmp/ckpt/llama3-8b --device cuda --peer none --tp-size $tp \
        --json "$OUT/bench_llama3_8b_tp$tp.json" 2>&1 | grep -v Writing | tail -3
done
