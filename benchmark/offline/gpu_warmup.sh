#!/usr/bin/env bash
# The start-up warm-up for decode batches that run without CUDA graphs, on one GPU, in one call of about
# eight minutes (`gpu_warmup.sh bench`: the workload alone, each way twice). Results go to $OUT (or ./out):
#   - the Triton kernels' tests and the CUDA engine tests (the new ones: eager decode batches of 1-39 rows,
#     without graphs and above graphs of 8 rows, compile nothing after start-up);
#   - that test again with the warm-up's eager decode steps left out, which must fail (the test can fail);
#   - the upstream workload without decode graphs (bench.py --cuda-graph-max-bs 0), a fresh process's first
#     run and a second, with the warm-up's eager steps and without them: start-up time and tok/s.
set -uo pipefail
source benchmark/gpu_env.sh
[ -d /tmp/ckpt/qwen3-0.6b ] || python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/ckpt/qwen3-0.6b > /dev/null 2>&1
if [ "${1:-all}" != bench ]; then
timeout 150 python -m pytest -q -rfs -p no:cacheprovider tests/test_triton_kernels.py 2>&1 | tail -2
timeout 330 python -m pytest -q -rfs -p no:cacheprovider -m gpu tests/test_gpu_sampling.py tests/test_gpu.py \
    tests/test_fp8_kv.py tests/test_prefill_graph.py tests/test_launch.py 2>&1 | tee "$OUT/engine_tests.log" | tail -4
# without the warm-up's eager decode steps the new test must fail
timeout 120 python -c "
import sys, pytest
import minisgl.engine.warmup as w
w._eager_decode_sizes = lambda engine: []
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-m', 'gpu', 'tests/test_gpu_sampling.py', '-k', 'eager_decode_batches']))
" 2>&1 | tail -3 | sed "s/^/without eager warm-up: /"
fi
# each process with an empty Triton cache of its own, as on a fresh machine; the kernels Triton compiles
# after LLM() returns are counted (its post-compile hook)
bench() {
    TRITON_CACHE_DIR=$(mktemp -d) timeout 150 python -c "
import atexit, runpy, sys
import triton
from minisgl.llm import LLM
if '$1' == 'off':
    import minisgl.engine.warmup as w
    w._eager_decode_sizes = lambda engine: []
ready, late = [False], []
init = LLM.__init__
def traced_init(self, *a, **k):
    init(self, *a, **k)
    ready[0] = True
LLM.__init__ = traced_init
def hook(*a, **k):
    if ready[0]:
        late.append(getattr(k.get('fn'), 'name', '?'))
    return False
triton.knobs.runtime.jit_post_compile_hook = hook
atexit.register(lambda: print(f'compiled after LLM(): {len(late)} {sorted(set(late))}', flush=True))
sys.argv = ['bench.py', '--model', '/tmp/ckpt/qwen3-0.6b', '--device', 'cuda', '--peer', 'none', '--repeat', '2',
            '--cuda-graph-max-bs', '0']
runpy.run_path('benchmark/offline/bench.py', run_name='__main__')
" 2>&1 | grep -E "ready in|minisgl|compiled after" | tail -4 | sed "s/^/eager warm-up $1: /"
}
bench on
bench off
[ "${1:-all}" = bench ] && { bench on; bench off; }
