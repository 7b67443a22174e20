"""Where a burst of short prompts spends its time: the host's Python functions and the device's kernels.

    python benchmark/offline/burst_profile.py --model ckpt/qwen3-0.6b [--prompts 256] [--min-len 16]
        [--max-len 64] [--device cuda] [--json out.json]

A burst of new random prompts (no prefix shared), one greedy token each, through `LLM.generate`: the run is the
burst's admission, its prefill steps (more than the prefill graphs' 8 requests a step, so eager), the sampling
and the replies. After two untimed bursts (kernels compiled), three timed ones give the wall time; then one
under cProfile (the host's functions by cumulative time: where the host waits on the device shows as the
synchronising call) and one under the torch profiler (the device's kernels grouped by name, their total
against the span from the first kernel to the last, and the host's torch operators by their own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import random
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_profile import kernel_span_us, kernel_table  # noqa: E402

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402


def host_table(prof: Any, top: int) -> list[dict[str, Any]]:
    """The host's torch operators grouped by name, largest own time first."""
    rows = [
        {"name": e.key[:80], "self_us": e.self_cpu_time_total, "count": e.count}
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["self_us"])[:top]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a checkpoint folder (empty: the default model)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=3, help="timed bursts")
    p.add_argument("--no-profile", action="store_true", help="the timed bursts only")
    p.add_argument("--json")
    args = p.parse_args()
    rng = random.Random(0)
    llm = LLM(args.model or None, device=args.device, max_running_req=args.prompts)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def burst() -> list[list[int]]:
        return [
            [rng.randrange(1000, 40000) for _ in range(rng.randint(args.min_len, args.max_len))]
            for _ in range(args.prompts)
        ]

    def sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for _ in range(2):
        llm.generate(burst(), params)
    walls = []
    for _ in range(args.rounds):
        prompts = burst()
        sync()
        start = time.perf_counter()
        llm.generate(prompts, params)
        sync()
        walls.append((time.perf_counter() - start) * 1e3)
    print("burst wall ms: " + " / ".join(f"{w:.1f}" for w in walls), flush=True)
    if args.no_profile:
        llm.shutdown()
        return

    prompts = burst()
    prof_py = cProfile.Profile()
    prof_py.enable()
    llm.generate(prompts, params)
    sync()
    prof_py.disable()
    text = io.StringIO()
    # file names alone: the functions, not where this machine keeps them
    pstats.Stats(prof_py, stream=text).strip_dirs().sort_stats("cumulative").print_stats(40)
    print(text.getvalue(), flush=True)

    prompts = burst()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    sync()
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        llm.generate(prompts, params)
        sync()
    wall = (time.perf_counter() - start) * 1e3
    kernels = kernel_table(prof)
    kernel_us = sum(k["us"] for k in kernels)
    print(f"profiled burst: wall {wall:.1f} ms, kernels {kernel_us / 1e3:.1f} ms, "
          f"first to last kernel {kernel_span_us(prof) / 1e3:.1f} ms", flush=True)  # fmt: skip
    for k in kernels[:15]:
        print(f"  {k['us']:9.1f} us {k['count']:5d}  {k['name']}")
    hosts = host_table(prof, 25)
    print("host operators by own time:")
    for h in hosts:
        print(f"  {h['self_us']:9.1f} us {h['count']:6d}  {h['name']}")
    llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"walls_ms": walls, "profiled_wall_ms": wall, "kernel_us": kernel_us, "kernels": kernels,
                 "host_ops": hosts, "prompts": args.prompts},
                f, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
