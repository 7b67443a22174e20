#!/usr/bin/env bash
# Prefill's row-scaled kernels (SiLU a program a row and the rotary kernel a program a token, both from 1,024
# rows) against the tree before (./abbase), on one GPU in one call of about eight minutes: the rotary, SiLU
# and CUDA engine tests, the kernels alone (prefill_parts.py, with torch's flash kernel beside the extend
# kernel), then the workload's prefill and decode GPU time (roofline.py's e2e section) with both trees on
# both model shapes. Results go to $OUT (or ./out).
set -uo pipefail
source benchmark/gpu_env.sh
BASE=${BASE:-abbase}
out=$(cd "$OUT" && pwd)
run() { (cd "$1" && shift && PYTHONPATH=$PWD:${PYTHONPATH#*:} "$@"); }
ckpt() { [ -d "/tmp/ckpt/$1" ] || python benchmark/offline/random_checkpoint.py "$1" "/tmp/ckpt/$1" > /dev/null 2>&1; }
timeout 150 python -m pytest -q -rfs -p no:cacheprovider tests/test_rotary_store.py tests/test_triton_kernels.py \
    -k "silu or rotary or rope" 2>&1 | tail -3
timeout 200 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu.py tests/test_fp8_kv.py \
    tests/test_prefill_graph.py 2>&1 | tail -3
timeout 120 python benchmark/offline/prefill_parts.py --json "$out/prefill_parts.json" 2>&1 | tail -8
ckpt qwen3-0.6b
ckpt llama3-8b
for model in ${MODELS:-qwen3-0.6b llama3-8b}; do
    for tree in . "$BASE"; do
        name=$([ "$tree" = . ] && echo new || echo base)
        echo "== $model $name"
        run "$tree" timeout 150 python benchmark/offline/roofline.py --model "/tmp/ckpt/$model" --sections e2e \
            --json "$out/e2e_${model}_$name.json" 2>&1 | grep -E "^e2e|Error" | cut -c1-300
    done
done
