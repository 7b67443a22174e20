"""The first long prompts of a process on a GPU, with the warm-up's products at the eager counts and without.

    python benchmark/offline/warm_counts.py --model ckpt/qwen3-0.6b [--no-warm] [--json out.json]

Eager prefill steps are padded to a few token counts (engine/prefill_graph.py's rounded_tokens); above the
largest prefill graph each count's products met cuBLAS's choice of kernel on their first step, until the warm-up
ran them at start (engine/warmup.py's `_warm_products`; `--no-warm` leaves them out). Times `LLM()`, then one new
prompt of each count from 2,304 to 8,192 tokens by 512 (each count's first step), then the same lengths again
(seen counts): each prompt's time to its first token, a request at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from prefill_latency import prompt_of  # noqa: E402

LENGTHS = list(range(2304 - 40, 8192, 512))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--no-warm", action="store_true", help="the warm-up without the eager counts' products")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import torch

    from minisgl import LLM, SamplingParams
    from minisgl.engine import warmup

    if args.no_warm:
        warmup._eager_prefill_counts = lambda engine: []  # type: ignore[assignment]
    start = time.perf_counter()
    llm = LLM(args.model, max_running_req=8, cache_type="naive")
    ready = time.perf_counter() - start
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    passes = []
    for seed in (0, 1):
        times = []
        for i, n in enumerate(LENGTHS):
            prompt = prompt_of(100 * seed + i, n)
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate([prompt], params)
            times.append((time.perf_counter() - t) * 1e3)
        passes.append(times)
    llm.shutdown()
    result = {
        "warm": not args.no_warm,
        "llm_ready_s": ready,
        "lengths": LENGTHS,
        "first_ms": passes[0],
        "again_ms": passes[1],
    }
    for name, times in (("first of each count", passes[0]), ("the same lengths again", passes[1])):
        print(f"{name}: median {statistics.median(times):.1f} ms, mean {statistics.mean(times):.1f}, "
              f"max {max(times):.1f}")  # fmt: skip
    print(f"LLM() ready in {ready:.2f} s (warm-up products {'on' if result['warm'] else 'off'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
