#!/usr/bin/env bash
# The LM head and sampling in one kernel (minisgl/kernel/lm_sample.py, engine/fused_head.py), on one GPU.
#   tests  its tests, the CUDA products' and the engine's sampling and decode tests (about three minutes)
#   sweep  its tiles against the engine's two launches (lm_sample.py), Qwen3-0.6B's and Llama-3-8B's vocabularies
#   bench  fresh processes' first runs of bench.py, the fused head on (up to 128 rows) and off alternating: one
#          stream of 512 new tokens and 64 streams (ROUNDS), then the upstream workload (temperature 0.6; top-k 50 /
#          top-p 0.9, whose filters need the logits) once each
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
modes=${*:-tests sweep bench}
if [[ " $modes " == *" tests "* ]]; then
    (timeout 150 python -m pytest -q -m gpu -p no:cacheprovider tests/test_cuda_gemm.py
     timeout 100 python -m pytest -q -p no:cacheprovider tests/test_lm_sample.py
     timeout 300 python -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_sampling.py tests/test_gpu.py \
        tests/test_fp8_kv.py tests/test_prefill_graph.py -k "not moe and not mixed") 2>&1 \
        | tee "$OUT/tests_lm_sample.log" | grep -E "passed|failed|error" | tail -5
fi
if [[ " $modes " == *" sweep "* ]]; then
    timeout 300 python benchmark/offline/lm_sample.py --models qwen3-0.6b --rows "${ROWS:-1,16,64,128,256}" \
        --json "$OUT/lm_sample_qwen3_0.6b.json" 2>&1 | tail -6
    timeout 200 python benchmark/offline/lm_sample.py --models llama3-8b --rows "${LLAMA_ROWS:-16,64,256}" \
        --json "$OUT/lm_sample_llama3_8b.json" 2>&1 | tail -4
fi
if [[ " $modes " == *" bench "* ]]; then
    [ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
    run() {  # run ROWS TAG [bench.py args]: the fused head up to ROWS rows (0: never)
        local rows=$1 tag=$2
        shift 2
        echo "== fused up to $rows rows: $tag"
        MINISGL_FUSED_SAMPLING=$rows timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
            --device cuda --peer none --json "$OUT/bench_${tag}_fused${rows}.json" "$@" 2>&1 | grep -E "minisgl" | tail -1
    }
    for r in ${ROUNDS:-1 2}; do
        run 128 "one_r$r" --num-requests 1 --min-len 512 --max-len 512
        run 0 "one_r$r" --num-requests 1 --min-len 512 --max-len 512
        run 128 "s64_r$r" --num-requests 64 --min-len 512 --max-len 512
        run 0 "s64_r$r" --num-requests 64 --min-len 512 --max-len 512
    done
    run 128 bf16
    run 0 bf16
    run 128 topp --top-k 50 --top-p 0.9
    run 0 topp --top-k 50 --top-p 0.9
fi
