#!/usr/bin/env bash
# Attention of fresh prompts over their own rows (kernel/fresh_attention.py, MINISGL_FRESH_PREFILL) on one Hopper
# GPU (carry ./.whl from benchmark/gpu_wheels.sh for the tests). Sections, in the order given (default: all): tests
# (the kernel's and the CUDA engine's with it on, the warm-up's no-compile checks among them), kernel
# (extend_flash.py's fresh cases, the extend kernel, torch's kernels and the fresh kernel's tiles), ttft (a long
# prompt's first token, off then on, fresh processes), bench (the upstream workload, off and on alternating, fresh
# processes' first runs, bf16 then the FP8 cache). Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv,noheader
CKPT=/tmp/ckpt/qwen3-0.6b
[ -d $CKPT ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b $CKPT > /dev/null 2>&1
for section in ${@:-tests kernel ttft bench}; do
    case $section in
    tests)
        timeout 400 python -m pytest -q -rfs -p no:cacheprovider tests/test_fresh_attention.py tests/test_rotary_store.py \
            2>&1 | tee "$OUT/tests_fresh_kernel.log" | tail -3
        timeout 400 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fp8_kv.py \
            tests/test_prefill_graph.py tests/test_mixed_chunk.py tests/test_gpu_sampling.py -k "not moe" 2>&1 |
            tee "$OUT/tests_fresh_engine.log" | tail -3
        ;;
    kernel)
        timeout 300 python benchmark/offline/extend_flash.py --cases ${CASES:-8k,32k,workload,q16_p0,q128_p0,q512_p0} \
            --fresh-configs "${FRESH_CONFIGS:-128,128,8,3;128,64,8,3;128,128,8,2;128,64,4,3;64,64,4,3;64,32,4,3}" \
            --json "$OUT/fresh_kernel.json" 2>&1 | grep -v Warning
        ;;
    ttft)
        for mode in 0 1; do
            echo "== MINISGL_FRESH_PREFILL=$mode"
            MINISGL_FRESH_PREFILL=$mode timeout 200 python benchmark/offline/prefill_latency.py --model $CKPT \
                --lens ${LENS:-1024,4096,8192,32768} --json "$OUT/fresh_ttft_$mode.json" 2>&1 |
                grep -E "start-up|prompt|Error"
        done
        ;;
    bench)
        for kv in auto fp8_e4m3; do
            for round in ${ROUNDS:-1 2}; do
                for mode in 0 1; do
                    echo "== kv $kv, MINISGL_FRESH_PREFILL=$mode, round $round"
                    MINISGL_FRESH_PREFILL=$mode timeout 120 python benchmark/offline/bench.py --model $CKPT \
                        --device cuda --peer none --kv-cache-dtype $kv \
                        --json "$OUT/fresh_bench_${kv}_${mode}_$round.json" 2>&1 | tail -1
                done
            done
        done
        ;;
    esac
done
