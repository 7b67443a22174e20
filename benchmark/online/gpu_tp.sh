#!/usr/bin/env bash
# The multi-GPU online run, in one run of at most 10 minutes on a GPU machine: random-weight bf16
# checkpoints of real shapes served by `python -m minisgl --tp-size $TP`, measured by
# benchmark/online/bench.py with arrivals replayed from its synthetic trace at several request rates.
# Phases, in order (name some to run only those: `gpu_tp.sh check dense`):
#   check  greedy completions of a tiny llama through the server at tp=$TP equal tp=1's (tp_check.py)
#   dense  Qwen3-32B's exact shape (64 layers), or $DENSE_LAYERS of them
#   moe    a Qwen3-235B-A22B-shaped MoE (128 experts, top-8) with $MOE_LAYERS of its 94 layers
#   small  (not run by default) the Qwen3-0.6B shape at tp=1, closed loop at 1, 64, 256 and 512 clients
#          on issue 14's requests (U[100, 1024] token-id prompts, 256 output tokens, temperature 0.6),
#          with LLM.generate's figure on the same requests beside each level
#   profile (not run by default) the 0.6B shape at tp=1 under 256 streams of 1,024 tokens: py-spy
#          records every server process (API server, tokenizer worker, scheduler) for 8 s mid-decode
#          (collapsed stacks a thread, idle included, in profile.tgz; read with profile_summary.py)
# Settings (environment):
#   TP=4                 the tensor-parallel size (default)
#   TP=2 SMALL=1         for a 2-GPU machine: 16 dense layers, 4 MoE layers
#   CPU=1                the same steps on a CPU (gloo, TP=2): tiny checkpoints, a short sweep; checks
#                        the script's logic where no GPU is
#   RATES="16 inf"       request rates (CPU: "4 inf"); NUM_REQUESTS=1000 (CPU: 16); OFFLINE=1 adds
#                        LLM.generate's figure on the same requests
#   DENSE_LAYERS, MOE_LAYERS   override the layer counts; CONCURRENCY="64 256" adds closed-loop levels
# Every step runs under `timeout`; results (JSON lines, text, server output) go to $OUT (or ./out).
# Python packages the machine lacks are installed from ./.whl if present and put on PYTHONPATH, which
# the servers the benchmark starts inherit.
set -uo pipefail
source benchmark/gpu_env.sh
CPU=${CPU:-0}
SMALL=${SMALL:-0}
if [ "$CPU" = 1 ]; then
    TP=${TP:-2} NUM_REQUESTS=${NUM_REQUESTS:-16} RATES=${RATES:-4 inf}
else
    TP=${TP:-4} NUM_REQUESTS=${NUM_REQUESTS:-1000} RATES=${RATES:-16 inf}
fi
OFFLINE=${OFFLINE:-0}
CONCURRENCY=${CONCURRENCY:-}
CKPT=${CKPT:-/tmp/ckpt}
if [ "$SMALL" = 1 ]; then
    DENSE_LAYERS=${DENSE_LAYERS:-16}
    MOE_LAYERS=${MOE_LAYERS:-4}
else
    DENSE_LAYERS=${DENSE_LAYERS:-64}
    MOE_LAYERS=${MOE_LAYERS:-8}
fi
# the sweep's lengths: the trace's own (ShareGPT-like) on GPUs, a small one on a CPU
if [ "$CPU" = 1 ]; then
    TRACE="--input-median 32 --input-max 128 --output-median 8 --output-max 32"
    ENGINE="--dtype float32"
    BUILD_S=120 SWEEP_S=600
else
    TRACE=""
    ENGINE=""
    BUILD_S=240 SWEEP_S=420
fi
echo "gpu_tp.sh: TP=$TP SMALL=$SMALL CPU=$CPU RATES='$RATES' NUM_REQUESTS=$NUM_REQUESTS OFFLINE=$OFFLINE" |
    tee "$OUT/gpu_tp.txt"
[ "$CPU" = 1 ] || nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a "$OUT/gpu_tp.txt"

# build NAME SHAPE LAYERS: a random checkpoint in $CKPT/NAME (tiny ones on a CPU)
build() {
    local name=$1 shape=$2 layers=$3
    if [ "$CPU" = 1 ]; then
        local variant=llama
        [ "$shape" = qwen3-235b-a22b ] && variant=qwen3-moe
        timeout "$BUILD_S" python -c "import sys; sys.path.insert(0, 'tests'); from tiny import build_variant; \
print('tiny', '$variant', 'checkpoint in', build_variant('$CKPT/$name', '$variant'))"
    else
        timeout "$BUILD_S" python benchmark/offline/random_checkpoint.py "$shape" "$CKPT/$name" --layers "$layers"
    fi
}

# sweep NAME: the request-rate sweep on $CKPT/NAME at tp=$TP
sweep() {
    local name=$1
    local offline=""
    [ "$OFFLINE" = 1 ] && offline="--offline"
    # -s TERM: bench.py stops its server on SIGTERM; -k: a last resort if it does not
    # shellcheck disable=SC2086
    timeout -s TERM -k 60 "$SWEEP_S" python benchmark/online/bench.py \
        --minisgl-args "--model $CKPT/$name --tp-size $TP $ENGINE" --prompt-ids --concurrency $CONCURRENCY \
        --request-rates $RATES --num-requests "$NUM_REQUESTS" $TRACE $offline \
        --json "$OUT/online_$name.jsonl" --server-log "$OUT/server_$name" 2>&1 |
        grep -v "Warning\|return func" | tee "$OUT/online_$name.txt"
}

phases=${*:-check dense moe}
for phase in $phases; do
    start=$SECONDS
    case $phase in
    check)
        timeout -s TERM -k 30 240 python benchmark/online/tp_check.py --tp-size "$TP" --log "$OUT/tp_check" 2>&1 |
            tail -3 | tee -a "$OUT/gpu_tp.txt"
        ;;
    dense)
        name=qwen3-32b-l$DENSE_LAYERS
        [ "$CPU" = 1 ] && name=tiny-llama
        build "$name" qwen3-32b "$DENSE_LAYERS" 2>&1 | tail -1 | tee -a "$OUT/gpu_tp.txt"
        sweep "$name"
        rm -rf "${CKPT:?}/$name"
        ;;
    moe)
        name=qwen3-235b-a22b-l$MOE_LAYERS
        [ "$CPU" = 1 ] && name=tiny-qwen3-moe
        build "$name" qwen3-235b-a22b "$MOE_LAYERS" 2>&1 | tail -1 | tee -a "$OUT/gpu_tp.txt"
        sweep "$name"
        rm -rf "${CKPT:?}/$name"
        ;;
    small)
        name=qwen3-0.6b
        [ "$CPU" = 1 ] && name=tiny-llama-small
        build "$name" qwen3-0.6b 28 2>&1 | tail -1 | tee -a "$OUT/gpu_tp.txt"
        small_levels="1 64 256 512" small_len=256 small_range="--min-len 100 --max-len 1024"
        [ "$CPU" = 1 ] && small_levels="1 4" small_len=16 small_range="--min-len 16 --max-len 64"
        # shellcheck disable=SC2086
        timeout -s TERM -k 60 "$SWEEP_S" python benchmark/online/bench.py \
            --minisgl-args "--model $CKPT/$name $ENGINE" --prompt-ids $small_range --concurrency $small_levels \
            --requests-per-level 1 --min-requests 1 --output-len $small_len --temperature 0.6 --offline \
            --json "$OUT/online_$name.jsonl" --server-log "$OUT/server_$name" 2>&1 |
            grep -v "Warning\|return func" | tee "$OUT/online_$name.txt"
        ;;
    profile)
        name=qwen3-0.6b
        [ -d "$CKPT/$name" ] || build "$name" qwen3-0.6b 28 2>&1 | tail -1 | tee -a "$OUT/gpu_tp.txt"
        python -m minisgl --model "$CKPT/$name" --port 30017 > "$OUT/profile_server.log" 2>&1 &
        server=$!
        timeout 180 python -c "import time, urllib.request as u
while True:
    try: u.urlopen('http://127.0.0.1:30017/health', timeout=1); break
    except Exception: time.sleep(0.5)"
        timeout -s TERM 240 python benchmark/online/bench.py --base-url http://127.0.0.1:30017 --name minisgl \
            --tokenizer "$CKPT/$name" --prompt-ids --min-len 100 --max-len 1024 --concurrency 256 \
            --requests-per-level 1 --output-len 1024 --temperature 0.6 2>&1 | grep -v "Warning\|return func" \
            > "$OUT/profile_bench.txt" &
        load=$!
        sleep 8
        py-spy dump --pid "$server" > "$OUT/profile_dump_api.txt" 2>&1
        for pid in $server $(pgrep -P "$server"); do
            role=$(tr '\0' ' ' < "/proc/$pid/cmdline" | cut -c1-200)
            echo "$pid $role" >> "$OUT/profile_pids.txt"
            py-spy record --idle --threads --rate 250 --duration 8 --format raw -o "$OUT/profile_$pid.txt" --pid "$pid" \
                > /dev/null 2>&1 &
        done
        wait $load
        cat "$OUT/profile_bench.txt"
        kill -TERM "$server"; wait "$server"
        # one archive: a GPU machine returns few files
        (cd "$OUT" && tar czf profile.tgz profile_* && rm -f profile_*.txt profile_server.log)
        ;;
    *)
        echo "unknown phase $phase (check, dense, moe, small, profile)"
        exit 2
        ;;
    esac
    echo "phase $phase: $((SECONDS - start)) s" | tee -a "$OUT/gpu_tp.txt"
done
