"""Mixed steps against the plain schedule, offline: where a workload's time goes by kind of step.

    python benchmark/offline/mixed_steps.py [--model M] [--runs 2] [--requests 48] [--max-running-req 16] [--budget 256]

More requests than rows and a small prefill budget, so that prompts are admitted (in chunks) while others
decode: the plain schedule runs prefill steps and decode steps, mixed steps
(`enable_mixed_chunk=True`) decode the running requests inside the prefill steps. Random token prompts of
U[50, 600] tokens and U[16, 128] greedy output tokens (seed 0) on the default model (or --model), without a
prefix cache; each run builds both engines in turn, plain first, after a short warm-up generate. Printed: the
engine's start (its warm-up included), output tok/s, and each kind of step's count and seconds (a step's
time is the wall clock to the next step).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def build(mixed: bool, args: argparse.Namespace) -> Any:
    """The engine of one schedule (an LLM) for --model, --max-running-req and --budget, without a prefix cache."""
    from minisgl import LLM

    return LLM(
        args.model,
        max_running_req=args.max_running_req,
        max_extend_tokens=args.budget,
        cache_type="naive",
        enable_mixed_chunk=mixed,
    )


def workload(requests: int) -> tuple[list[list[int]], list[Any]]:
    """Random token prompts of U[50, 600] tokens and U[16, 128] greedy output tokens, seed 0."""
    from minisgl import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(50, 600))] for _ in range(requests)]
    return prompts, [SamplingParams(max_tokens=rng.randint(16, 128), ignore_eos=True) for _ in prompts]


def run(mixed: bool, args: argparse.Namespace) -> tuple[float, float, dict[str, tuple[int, float]]]:
    from minisgl.core import Batch

    built = time.perf_counter()
    llm = build(mixed, args)
    ready = time.perf_counter() - built
    prompts, params = workload(args.requests)
    steps: list[tuple[float, str | None]] = []

    def observe(batch: Batch | None) -> None:
        kind = None
        if batch is not None:
            kind = "mixed" if batch.num_decode_rows else batch.phase
        steps.append((time.perf_counter(), kind))

    llm.generate(prompts[:4], params[:4])
    llm.step_observers.append(observe)
    start = time.perf_counter()
    out: list[dict[str, Any]] = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    kinds: dict[str, list[float]] = {}
    for (t0, kind), (t1, _) in zip(steps, steps[1:]):
        if kind is not None:
            kinds.setdefault(kind, []).append(t1 - t0)
    tokens = sum(len(o["token_ids"]) for o in out)
    return ready, tokens / elapsed, {k: (len(v), sum(v)) for k, v in kinds.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a model folder or GGUF file (default: the embedded model)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--max-running-req", type=int, default=16)
    p.add_argument("--budget", type=int, default=256, help="the prefill budget (max_extend_tokens)")
    args = p.parse_args()
    print(
        "| run | schedule | ready (s) | output tok/s | prefill steps (s) | mixed steps (s) | decode steps (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    for i in range(args.runs):
        for mixed in (False, True):
            ready, rate, kinds = run(mixed, args)
            cells = [
                f"{kinds[k][0]} ({kinds[k][1]:.2f})" if k in kinds else "-"
                for k in ("prefill", "mixed", "decode")
            ]
            print(
                f"| {i + 1} | {'mixed' if mixed else 'plain'} | {ready:.1f} | {rate:.1f} | {' | '.join(cells)} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
