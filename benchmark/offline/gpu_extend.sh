#!/usr/bin/env bash
# Prefill (extend) attention's tiles on one GPU, in one call of about five minutes (`verify`: the tests of the
# kernel and the engine, the first token and the workload with the engine's tiles as they now are):
#   - the Triton kernels' extend and FP8 tests (unmasked tiles below the diagonal, longest blocks first, bf16
#     on the GPU among them);
#   - extend_sweep.py: the engine's tiles, a sweep of ExtendConfig and torch's SDPA on prompts of 8k and 32k
#     tokens, the last 8k chunk of a 32k prompt, and one prefill step of the upstream workload;
#   - prefill_latency.py, a fresh process each: the first token at 16 to 32,768 prompt tokens with the
#     engine's tiles, then with the sweep's best over the four cases (extend_pick.py).
# Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
if [ "${1:-sweep}" = verify ]; then
    timeout 200 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py 2>&1 |
        tee "$OUT/kernel_tests.log" | tail -2
    timeout 240 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_prefill_graph.py tests/test_gpu.py \
        tests/test_fp8_kv.py 2>&1 | tee "$OUT/engine_tests.log" | tail -2
    timeout 120 python benchmark/offline/prefill_latency.py --model /tmp/ckpt/qwen3-0.6b --lens 16,1024,8192,32768 \
        --json "$OUT/latency_extend.json" 2>&1 | grep -E "prompt|Error"
    bench_tiles auto -
    exit 0
fi
timeout 200 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py -k "extend or fp8" \
    2>&1 | tee "$OUT/kernel_tests.log" | tail -2
timeout 240 python benchmark/offline/extend_sweep.py --json "$OUT/extend_sweep.json" 2>&1 | grep -v Warning | tail -12
best=$(python benchmark/offline/extend_pick.py "$OUT/extend_sweep.json")
for tiles in - "$best"; do
    echo "== prefill_latency, extend tiles $tiles"
    extra=()
    [ "$tiles" != - ] && extra=(--extend-tiles "$tiles")
    timeout 120 python benchmark/offline/prefill_latency.py --model /tmp/ckpt/qwen3-0.6b --lens 16,1024,8192,32768 \
        "${extra[@]}" --json "$OUT/latency_extend_${tiles//,/_}.json" 2>&1 | grep -E "prompt|Error"
done
