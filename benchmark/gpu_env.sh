# Sourced by the GPU scripts: results under $OUT (or ./out), the checkout on PYTHONPATH, and the Python
# packages a machine without network lacks installed from ./.whl (benchmark/gpu_wheels.sh) when present,
# their commands (py-spy) on PATH. Child processes (servers) inherit all of it.
OUT=${OUT:-out}
mkdir -p "$OUT"
export OUT PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl > /dev/null && export PYTHONPATH=$PYTHONPATH:/tmp/site PATH=/tmp/site/bin:$PATH
fi
# bench_tiles KV TILES: the upstream workload on a random Qwen3-0.6B checkpoint through bench.py, a fresh
# process's first run and a second, with the KV cache KV and the decode tiles TILES (-: the engine's choice)
bench_tiles() {
    [ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
    local tiles=()
    [ "$2" != - ] && tiles=(--decode-tiles "$2")
    echo "== kv=$1 tiles=$2"
    timeout 100 python benchmark/offline/bench.py --model /tmp/ckpt/qwen3-0.6b --device cuda --peer none \
        --repeat 2 --kv-cache-dtype "$1" "${tiles[@]}" 2>&1 | tail -2
}
