#!/usr/bin/env bash
# The decode step without each kind of small kernel (step_parts.py: norms, SiLU, rotary), against the engine
# as it is, on one GPU in one call of about four minutes: the ceiling of fusing each away, by batch size.
# Results go to $OUT (or ./out); the last lines print each part's saving.
set -uo pipefail
source benchmark/gpu_env.sh
# the parts as they were measured on 2026-12-03: the norms as launches (folded, there are none to drop)
export MINISGL_FOLD_NORMS=${MINISGL_FOLD_NORMS:-0}
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
for part in none norms silu rotary; do
    timeout 140 python benchmark/offline/step_parts.py --model /tmp/ckpt/qwen3-0.6b --drop "$part" \
        --json "$OUT/$part.json" 2>&1 | tail -1 | cut -c1-120
done
python benchmark/offline/step_parts.py --compare "$OUT"/{none,norms,silu,rotary}.json
