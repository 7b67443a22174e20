"""What the timeline trace (minisgl/utils/trace.py) costs, off and on, on the offline workload of bench.py.

Off: the tracer calls one scheduler step makes, timed with tracing off (each returns after one
attribute check), against the time of a step. On: the workload run with a trace, every tracer call
timed as it runs, so the share of the run spent tracing is measured directly rather than read off two
noisy wall-clock runs; the merge at shutdown is timed apart (it is outside the generate call).

    python benchmark/offline/trace_cost.py --num-requests 32 --min-len 32 --max-len 128 --threads 1
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import time
import timeit
from collections import Counter
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import make_workload, run_minisgl  # noqa: E402

from minisgl.utils import trace  # noqa: E402

# the calls of one step of the plain loop, with a request's arrival and its queued point
STEP_CALLS = ("step_begin", "step_prepared", "forward_begin", "forward_end", "results_begin", "step_done")


def cost_when_off(repeat: int = 1_000_000) -> float:
    """Seconds per step of the tracer calls a step makes, with tracing off."""
    tracer = trace.Tracer()
    assert not tracer.on

    def one_step() -> None:
        tracer.step_begin()
        tracer.step_prepared(None)
        tracer.forward_begin()
        tracer.forward_end()
        tracer.results_begin()
        tracer.step_done(None, [])  # type: ignore[arg-type]
        tracer.results_end()

    return min(timeit.repeat(one_step, number=repeat, repeat=5)) / repeat


def timed_tracer() -> tuple[Counter[str], Counter[str]]:
    """Wrap every public call of the process's tracer with a timer: (seconds, calls) per method."""
    seconds: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    names = [*STEP_CALLS, "results_end", "point", "arrivals"]
    for name in names:
        method = getattr(trace.TRACE, name)

        @functools.wraps(method)
        def timed(*args: Any, _method: Any = method, _name: str = name) -> None:
            start = time.perf_counter()
            _method(*args)
            seconds[_name] += time.perf_counter() - start
            calls[_name] += 1

        setattr(trace.TRACE, name, timed)
    return seconds, calls


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--device", default=None, choices=[None, "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-running-req", type=int, default=256)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")

    from minisgl.models.config import ModelConfig
    from minisgl.utils.hf import load_hf_config, resolve_model_path

    vocab = ModelConfig.from_hf(load_hf_config(resolve_model_path(args.model))).vocab_size
    work = make_workload(args.num_requests, args.min_len, args.max_len, vocab, 0)

    off = cost_when_off()
    seconds, calls = timed_tracer()
    merge = trace.merge_trace
    merge_s: list[float] = []

    def timed_merge(path: str) -> int:
        start = time.perf_counter()
        count = merge(path)
        merge_s.append(time.perf_counter() - start)
        return count

    trace.merge_trace = timed_merge
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "run.json")
        result, _ = run_minisgl(args, work, trace=path)
        size = os.path.getsize(path)
    traced_s = sum(seconds.values())
    print(f"workload: {len(work.prompts)} requests, {work.output_tokens} output tokens; device {args.device}")
    print(f"{result.name}: {result.seconds:.2f} s for the generate call, {calls['step_done']} steps in all")
    print(f"tracing off: {off * 1e9:.0f} ns of tracer calls per step")
    print(
        f"tracing on: {traced_s * 1e3:.1f} ms in tracer calls (the warm-up's included: an upper bound), "
        f"{traced_s / calls['step_done'] * 1e6:.1f} us per step, {100 * traced_s / result.seconds:.2f}% of the run"
    )
    print(f"merge at shutdown: {merge_s[0] * 1e3:.1f} ms, {size / 1e6:.2f} MB written")
    for name in sorted(seconds, key=seconds.__getitem__, reverse=True):
        print(f"  {name:<14} {calls[name]:6d} calls {seconds[name] * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
