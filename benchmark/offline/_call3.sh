set -uo pipefail
OUT=${OUT:-out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null && export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
timeout 60 python benchmark/offline/tp_comm.py 2>&1 | grep -v "^\[W\|NCCL INFO" | tee $OUT/tp_comm.txt | tail -14
timeout 100 python -m pytest -q -rf -p no:cacheprovider --timeout 60 tests/test_tp.py -k "server or nodes" 2>&1 | tee $OUT/tp_server_tests.log | tail -4
timeout 60 python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b 2>&1 | tail -1
timeout 120 python benchmark/offline/bench.py --model /tmp/ckpt/llama3-8b --device cuda --peer none --tp-size 2 --num-requests 64 --trace $OUT/trace_8b_tp2.json 2>&1 | tail -3
rm -rf /tmp/ckpt/llama3-8b
bash benchmark/offline/gpu_tp.sh moe 2>&1 | tail -3
