"""Start-up cost of MINISGL_CPU_COMPILE: what the first decode steps of a process pay to compile.

Each case runs in a fresh child process on the default model (one torch thread): LLM(), then decode
batches of 1, 3 and 16 streams (8 new tokens each; the three batch sizes reach the three graphs the
step compiles: size 1, 2-4 rows on the packed weights, more rows on the float ones), then the same
batches again. The first pass less the second is what compilation cost.
- eager: MINISGL_CPU_COMPILE off, the reference;
- compiled, cold: inductor's on-disk cache empty (a fresh TORCHINDUCTOR_CACHE_DIR): a first run;
- compiled, warm: the same cache again: every later process (dynamo still traces the model).
    python benchmark/offline/cpu_compile.py

`--steady` measures throughput instead, in one process under the same load: one engine with the
compiled step, each scenario (N streams of 32-token prompts, 128 new tokens each) run alternately eager
and compiled, `--rounds` times, after a warm-up of each. Output tokens/s, the median and the range.
    python benchmark/offline/cpu_compile.py --steady --rounds 5
Across processes: benchmark/offline/bench.py --scenarios 1,16,64, run with the variable off and on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from minisgl import LLM

BATCHES = [1, 3, 16]


def child() -> None:
    import torch

    torch.set_num_threads(1)
    from minisgl import LLM
    from minisgl.core import SamplingParams

    start = time.perf_counter()
    llm = LLM(None, max_running_req=16)
    build = time.perf_counter() - start
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    passes = []
    for _ in range(2):
        start = time.perf_counter()
        for n in BATCHES:
            llm.generate([[100 + i + j for j in range(32)] for i in range(n)], params)
        passes.append(time.perf_counter() - start)
    llm.shutdown()
    print(json.dumps({"build": build, "first": passes[0], "second": passes[1]}))


def _rate(llm: LLM, prompts: list[list[int]], eager: bool) -> float:
    """Output tokens/s of one generate of `prompts`, 128 greedy tokens each, eager or compiled."""
    from contextlib import nullcontext

    from minisgl.core import SamplingParams

    params = SamplingParams(max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    with llm.engine.compiled_decode.eager() if eager else nullcontext():
        llm.generate(prompts, params)
    return len(prompts) * 128 / (time.perf_counter() - start)


def steady(rounds: int, scenarios: list[int]) -> None:
    import statistics

    import torch

    torch.set_num_threads(1)
    os.environ["MINISGL_CPU_COMPILE"] = "1"
    from minisgl import LLM

    llm = LLM(None, max_running_req=max(scenarios))
    rates: dict[tuple[int, bool], list[float]] = {}
    for n in scenarios:
        prompts = [[100 + 3 * i + j for j in range(32)] for i in range(n)]
        # a warm-up of each, which compiles this size
        _rate(llm, prompts, True), _rate(llm, prompts, False)
        for i in range(rounds):
            # the order alternates, so a drift of the machine's load falls on both alike
            for eager in (True, False) if i % 2 == 0 else (False, True):
                rates.setdefault((n, eager), []).append(_rate(llm, prompts, eager))
    llm.shutdown()
    print(f"load average (1, 5, 15 min) at the end: {os.getloadavg()}")
    print("| streams | eager tok/s | compiled tok/s | compiled / eager |")
    print("|---|---|---|---|")
    for n in scenarios:
        e, c = rates[(n, True)], rates[(n, False)]
        me, mc = statistics.median(e), statistics.median(c)
        print(
            f"| {n} | {me:.1f} ({min(e):.1f}-{max(e):.1f}) | {mc:.1f} ({min(c):.1f}-{max(c):.1f}) | {mc / me:.2f}x |"
        )


def run_case(compile_on: bool, cache_dir: str) -> dict[str, float]:
    env = dict(os.environ, MINISGL_CPU_COMPILE=str(int(compile_on)), TORCHINDUCTOR_CACHE_DIR=cache_dir)
    out = subprocess.run(
        [sys.executable, __file__, "--child"], env=env, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--warm-runs", type=int, default=2, help="runs of the warm case")
    p.add_argument("--steady", action="store_true", help="throughput, eager and compiled alternately")
    p.add_argument("--rounds", type=int, default=5, help="--steady: runs of each scenario and mode")
    p.add_argument("--scenarios", default="1,16,64", help="--steady: stream counts, comma separated")
    args = p.parse_args()
    if args.child:
        child()
        return
    if args.steady:
        steady(args.rounds, [int(n) for n in args.scenarios.split(",")])
        return
    with tempfile.TemporaryDirectory() as cache_dir:
        cases = [("eager", run_case(False, cache_dir)), ("compiled, cold", run_case(True, cache_dir))]
        cases += [("compiled, warm", run_case(True, cache_dir)) for _ in range(args.warm_runs)]
    print(f"{'case':16} {'LLM()':>8} {'first pass':>11} {'second pass':>12} {'compile cost':>13}")
    for name, r in cases:
        cost = r["first"] - r["second"]
        print(f"{name:16} {r['build']:7.2f}s {r['first']:10.2f}s {r['second']:11.2f}s {cost:12.2f}s")


if __name__ == "__main__":
    main()
