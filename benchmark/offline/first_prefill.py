"""The first prompts after start: a fresh engine on the default model prefills 500-token prompts, one at a time.

    python benchmark/offline/first_prefill.py [--threads 1] [--prompts 6] [--len 500]

Each prompt is new (no prefix shared), one new token each; the rate of each (prompt tokens/s) is printed
in order, so the first one, which writes K/V into pool pages no request has touched yet, stands apart.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--len", type=int, default=500)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from minisgl import LLM, SamplingParams

    llm = LLM(None, max_running_req=4)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    rates = []
    for i in range(args.prompts):
        prompt = [(1000 + 7 * i + 13 * j) % 40000 + 100 for j in range(args.len)]
        start = time.perf_counter()
        llm.generate([prompt], params)
        rates.append(args.len / (time.perf_counter() - start))
    llm.shutdown()
    print("prompt tok/s, in order: " + ", ".join(f"{r:.0f}" for r in rates))


if __name__ == "__main__":
    main()
