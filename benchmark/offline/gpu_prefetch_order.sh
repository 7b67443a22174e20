#!/usr/bin/env bash
# Two switches of the decode step on one GPU: the L2 prefetch of the next GEMM's weight (kernel/prefetch.py,
# MINISGL_L2_PREFETCH) and decode attention's programs longest context first (MINISGL_DECODE_LONGEST_FIRST).
# Results go to $OUT (or ./out). Parts (all by default; about nine minutes together):
#   tests     the kernel tests (the same bits either way) and the engine's tokens with each switch on
#   gemms     a step's GEMMs with their norms and SiLU: off, prefetching, and L2-hot weights (l2_prefetch.py)
#   order     decode attention in batch order and longest first, 1-4 splits, both pools (decode_splits.py)
#   steps     the decode graph at every captured batch size: neither switch, each one (roofline.py steps)
#   workload  the upstream workload with each switch on (bench.py, a fresh process's first run and a second)
set -uo pipefail
source benchmark/gpu_env.sh
parts=${1:-tests,gemms,order,steps,workload}
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
if [[ $parts == *tests* ]]; then
    timeout 90 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py \
        -k "prefetch or norm or silu or decode" 2>&1 | tee "$OUT/kernel_tests.log" | tail -2
    timeout 150 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py \
        -k "prefetch or longest or float32_greedy" 2>&1 | tee "$OUT/engine_tests.log" | tail -2
fi
if [[ $parts == *gemms* ]]; then
    timeout 120 python benchmark/offline/l2_prefetch.py --json "$OUT/l2_prefetch.json" 2>&1 | tee "$OUT/l2_prefetch.log"
fi
if [[ $parts == *order* ]]; then
    timeout 150 python benchmark/offline/decode_splits.py --sweep order --batches 16,32,64,96,128,192,256 \
        --json "$OUT/decode_order.json" 2>&1 | tee "$OUT/decode_order.log"
fi
if [[ $parts == *steps* ]]; then
    for setting in "0 0" "1 0" "0 1"; do
        read -r pf lf <<< "$setting"
        name=prefetch${pf}_longest$lf
        MINISGL_L2_PREFETCH=$pf MINISGL_DECODE_LONGEST_FIRST=$lf timeout 120 python benchmark/offline/roofline.py \
            --model /tmp/ckpt/qwen3-0.6b --sections steps --json "$OUT/steps_$name.json" > "$OUT/steps_$name.log" 2>&1
        grep -E "bs=(1|8|16|32|64|128|256):" "$OUT/steps_$name.log" | cut -c1-90 | sed "s/^/$name /"
        grep -iE "^\w*error" "$OUT/steps_$name.log" | tail -2
    done
fi
if [[ $parts == *workload* ]]; then
    for setting in "0 1" "0 0" "1 0"; do
        read -r pf lf <<< "$setting"
        MINISGL_L2_PREFETCH=$pf MINISGL_DECODE_LONGEST_FIRST=$lf timeout 100 python benchmark/offline/bench.py \
            --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none --repeat 2 2>&1 | grep -E "minisgl" | tail -2 |
            sed "s/^/prefetch=$pf longest=$lf /"
    done
fi
