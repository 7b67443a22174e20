"""A burst of short prompts on one GPU: the first token of every prompt, with the short prompts' own prefill tiles
and with the long prompts' tiles, alternating in one process.

    python benchmark/offline/short_prompts.py --model ckpt/qwen3-0.6b [--prompts 256] [--min-len 16] [--max-len 64]
        [--rounds 3] [--json out.json]

Every prompt is new (random tokens, no prefix shared) and asks for one token, so the run is the burst's prefill
steps: more than the prefill graphs' 8 requests a step, so they run eagerly, the extend kernel at the tiles
`kernel/attention.py`'s `extend_config` picks by the step's longest prompt. Each round times `generate` once with
SHORT_QUERIES as the engine has it (short tiles up to that many new tokens) and once with 0 (the long prompts'
tiles for every step), each after an untimed run of the same setting (its kernels compiled); printed: seconds and
prompt tokens/s, every round.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from minisgl.core import SamplingParams  # noqa: E402
from minisgl.kernel import attention  # noqa: E402
from minisgl.llm import LLM  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a checkpoint folder (empty: the default model)")
    p.add_argument("--prompts", type=int, default=256)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default="cuda")
    p.add_argument("--json")
    args = p.parse_args()
    rng = random.Random(0)
    llm = LLM(args.model or None, device=args.device, max_running_req=args.prompts)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    engine_queries = attention.SHORT_QUERIES
    results: list[dict[str, float]] = []
    for r in range(args.rounds):
        for queries in (engine_queries, 0):
            attention.SHORT_QUERIES = queries
            prompts = [
                [rng.randrange(1000, 40000) for _ in range(rng.randint(args.min_len, args.max_len))]
                for _ in range(args.prompts)
            ]
            llm.generate(prompts, params)  # compiles this setting's variant; the timed prompts are new ones
            prompts = [[t + 1 for t in prompt] for prompt in prompts]
            start = time.perf_counter()
            llm.generate(prompts, params)
            seconds = time.perf_counter() - start
            tokens = sum(len(p) for p in prompts)
            results.append(
                {"round": r, "short_queries": queries, "s": seconds, "prompt_tok_s": tokens / seconds}
            )
            print(f"round {r}, short tiles up to {queries} new tokens: {seconds * 1e3:.1f} ms, "
                  f"{tokens / seconds:,.0f} prompt tok/s", flush=True)  # fmt: skip
    attention.SHORT_QUERIES = engine_queries
    llm.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
