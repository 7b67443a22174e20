#!/usr/bin/env bash
# The MLP's gate|up projection and its activation in one Triton GEMM launch (MINISGL_FUSED_GATE_UP) on
# one GPU, one call of about five minutes:
#   - the Triton GEMM's kernel tests (bf16 too, on a GPU) and the CUDA engine tests with the switch on;
#   - the roofline's decode steps at every captured batch size, off then on;
#   - the upstream workload through bench.py (a fresh process's first run and a second), off then on.
# Extra environment (MINISGL_FUSED_DECODE_ROPE=1, ...) applies to both sides. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
timeout 120 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py -k "gemm" 2>&1 |
    tee "$OUT/gemm_tests.log" | tail -2
MINISGL_FUSED_GATE_UP=1 timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py \
    tests/test_fp8_kv.py tests/test_gpu_sampling.py 2>&1 | tee "$OUT/engine_tests.log" | tail -2
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for fused in 0 1; do
    MINISGL_FUSED_GATE_UP=$fused timeout 100 python benchmark/offline/roofline.py --model /tmp/ckpt/qwen3-0.6b \
        --sections steps --json "$OUT/steps_gate_up$fused.json" 2>&1 |
        grep -E "bs=(1|4|8|16|32|64|128|256):" | cut -c1-90 | sed "s/^/gate_up=$fused /"
done
for fused in 0 1; do
    MINISGL_FUSED_GATE_UP=$fused timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b \
        --device cuda --peer none --repeat 2 2>&1 | tail -2 | sed "s/^/gate_up=$fused /"
done
