"""The scheduler's admission of a burst of short prompts: PrefillManager.schedule_next_batch's own time, summed over
the burst's prefill steps.

    python benchmark/offline/burst_admission.py [--requests 256] [--model FOLDER] [--device cpu]

A burst of new random prompts of 16-64 tokens, one greedy token each, through `LLM.generate` (max_running_req the
burst's size, so that every prompt is admitted as soon as the token budget allows): each step's admission matches
the prompt against the prefix cache, checks for rows and KV room, compares its head with the prompts admitted to
this step and the last (in_batch_prefix_share) and writes it into the token pool. Without --model, a one-layer
random Qwen3 of tests/tiny.py, whose forward leaves the admission's host work to dominate. Printed: the admission's
ms a burst, the median of 5 bursts, each and the step count.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from typing import Any

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.llm import LLM  # noqa: E402
from minisgl.scheduler import prefill  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--model", default="", help="a checkpoint folder (empty: a one-layer random Qwen3)")
    p.add_argument("--device", default="cpu")
    args = p.parse_args()
    folder = args.model
    if not folder:
        from tiny import build_variant

        folder = build_variant(tempfile.mkdtemp(), "qwen3")
    n = args.requests
    llm = LLM(folder, device=args.device, max_running_req=n)
    rng = random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(10, 200) for _ in range(rng.randint(16, 64))] for _ in range(n)]

    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(prompts(), params)
    schedule = prefill.PrefillManager.schedule_next_batch
    spent: list[float] = []

    def timed(self: prefill.PrefillManager, budget: int) -> Any:
        start = time.perf_counter()
        batch = schedule(self, budget)
        spent.append(time.perf_counter() - start)
        return batch

    prefill.PrefillManager.schedule_next_batch = timed  # type: ignore[method-assign]
    bursts = []
    for _ in range(5):
        spent.clear()
        llm.generate(prompts(), params)
        bursts.append(sum(spent) * 1e3)
    steps = len(spent)
    prefill.PrefillManager.schedule_next_batch = schedule  # type: ignore[method-assign]
    llm.shutdown()
    print(f"{n} prompts: admission {sorted(bursts)[2]:.2f} ms a burst (median of 5; "
          f"{', '.join(f'{b:.2f}' for b in bursts)}), {steps} prefill steps")  # fmt: skip


if __name__ == "__main__":
    main()
