set -uo pipefail
OUT=${OUT:-out}; mkdir -p $OUT
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null && export PYTHONPATH=.:/tmp/site PYTHONUNBUFFERED=1
export PATH=/tmp/site/bin:$PATH
which py-spy
timeout 60 python benchmark/offline/random_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b 2>&1 | tail -1
python benchmark/offline/bench.py --model /tmp/ckpt/llama3-8b --device cuda --peer none --tp-size 2 --num-requests 128 --repeat 1 > $OUT/bench.log 2>&1 &
BP=$!
for i in $(seq 90); do grep -q 'engine ready' $OUT/bench.log && break; sleep 1; done; sleep 6
timeout 20 py-spy dump --pid $BP --native > $OUT/dump0.txt 2>&1
timeout 30 py-spy record --pid $BP --subprocesses --idle --native -r 200 -d 12 --format raw -o $OUT/prof.txt > $OUT/pyspy.log 2>&1
wait $BP; tail -2 $OUT/bench.log
python - <<'PY'
import os,collections
out=os.environ.get('OUT','out')
c=collections.Counter()
try:
    for line in open(f'{out}/prof.txt'):
        stack,_,n=line.rstrip().rpartition(' ')
        frames=stack.split(';')
        c[';'.join(frames[-4:])]+=int(n)
except Exception as e: print(e)
for k,v in c.most_common(25): print(v,k[-300:])
PY
