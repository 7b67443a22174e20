#!/usr/bin/env bash
# Tensor parallelism and the GPU fast path on a 2-GPU machine. Each phase named runs, in order (the
# whole set takes more than the ten minutes of one device call: split it):
#   tests   the tp=2 tests over NCCL (offline and served), the GPU, Triton-kernel and structured-output
#           tests
#   trace   a traced GPU run of the 0.6B shape, drawn as a timeline
#   dense   the upstream offline workload on a Llama-3-8B-shaped checkpoint at tp=1 and tp=2
#   moe     the same workload on a Qwen3-30B-A3B-shaped MoE (all 48 layers) at tp=2
#   api     the device paths of the API's sampling fields (logit_bias, min_tokens, prompt logprobs) and
#           of structured output under overlap, on one GPU
#   diag    where a tp=2 step's host time goes: native stacks of every rank sampled during a run (py-spy
#           from ./.whl), then the same run with the plain loop instead of the overlap loop
# Results go to $OUT (or ./out). Python packages the machine lacks are installed from ./.whl if present.
set -uo pipefail
source benchmark/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
phases=${*:-tests trace dense moe}
for phase in $phases; do
case $phase in
tests)
    DUMP_AFTER_S=60 timeout 90 python benchmark/offline/tp_smoke.py 2>&1 | tee "$OUT/tp_smoke.log" | tail -4
    timeout 400 python -m pytest -q -rfs -p no:cacheprovider --timeout 120 tests/test_tp.py \
        2>&1 | tee "$OUT/tp_tests.log" | tail -8
    timeout 200 python -m pytest -q -rf -p no:cacheprovider --timeout 100 tests/test_gpu.py \
        tests/test_triton_kernels.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -8
    timeout 100 python -m pytest -q -rf -p no:cacheprovider --timeout 60 tests/test_structured.py \
        -k "not default_model" 2>&1 | tee "$OUT/structured_tests.log" | tail -5
    ;;
trace)
    python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
    timeout 90 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
        --num-requests 64 --trace "$OUT/trace_gpu.json" 2>&1 | tail -1
    timeout 60 python examples/plot_trace.py "$OUT/trace_gpu.json" -o "$OUT/trace_gpu.png" 2>&1 | tail -1
    ;;
dense)
    timeout 120 python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b 2>&1 | tail -1
    for tp in 1 2; do
        timeout 120 python benchmark/offline/bench.py --model /tmp/ckpt/llama3-8b --device cuda --peer none \
            --tp-size $tp --json "$OUT/bench_llama3_8b_tp$tp.json" 2>&1 | tail -1
    done
    ;;
moe)
    timeout 150 python benchmark/offline/random_checkpoint.py qwen3-30b-a3b /tmp/ckpt/qwen3-30b-a3b 2>&1 | tail -1
    timeout 200 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-30b-a3b --device cuda --peer none \
        --tp-size 2 --json "$OUT/bench_qwen3_30b_a3b_tp2.json" 2>&1 | tail -1
    ;;
api)
    timeout 200 python -m pytest -q -rf -p no:cacheprovider --timeout 100 tests/test_gpu.py \
        tests/test_logit_bias_min_tokens.py tests/test_prompt_logprobs.py 2>&1 | tee "$OUT/api_gpu_tests.log" | tail -6
    timeout 120 python -m pytest -q -rf -p no:cacheprovider --timeout 60 tests/test_structured.py \
        -k "not default_model" 2>&1 | tee "$OUT/structured_tests.log" | tail -5
    ;;
diag)
    timeout 120 python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b 2>&1 | tail -1
    python benchmark/offline/bench.py --model /tmp/ckpt/llama3-8b --device cuda --peer none --tp-size 2 \
        --num-requests 128 --repeat 1 > "$OUT/diag_bench.log" 2>&1 &
    bench=$!
    for _ in $(seq 120); do grep -q "engine ready" "$OUT/diag_bench.log" && break; sleep 1; done
    sleep 5
    for k in 1 2 3 4 5; do
        for pid in $bench $(pgrep -P $bench); do
            echo "== sample $k pid $pid" >> "$OUT/diag_stacks.txt"
            timeout 10 py-spy dump --native --pid "$pid" >> "$OUT/diag_stacks.txt" 2>&1
        done
        sleep 1
    done
    wait $bench; tail -1 "$OUT/diag_bench.log"
    MINISGL_DISABLE_OVERLAP_SCHEDULING=1 timeout 150 python benchmark/offline/bench.py --model /tmp/ckpt/llama3-8b \
        --device cuda --peer none --tp-size 2 --num-requests 128 --repeat 1 2>&1 | tail -1
    ;;
*) echo "unknown phase $phase (tests, trace, dense, moe, api, diag)"; exit 2 ;;
esac
done
