"""Structured output's cost: a batch where half the requests follow a JSON schema, against the same
batch unconstrained, in one run on one engine.

64 chat prompts on the default model; every request generates exactly --max-tokens tokens (the
unconstrained ones ignore EOS; the schema asks for at least 8 people, about 200 tokens, so no
constrained output can close within the budget and each computes a mask at every step). Runs
alternate (free, constrained, free, ...) so that the machine's load weighs on both alike.
    python benchmark/offline/structured.py --max-tokens 96 --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo", "Lima"]},
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "member"],
    "additionalProperties": False,
}
SCHEMA = {
    "type": "object",
    "properties": {"people": {"type": "array", "items": PERSON, "minItems": 8}},
    "required": ["people"],
    "additionalProperties": False,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--rounds", type=int, default=2, help="pairs of runs (free, then half constrained)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    p.add_argument("--device", default=None, choices=[None, "cpu", "cuda"])
    args = p.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    from minisgl import LLM
    from minisgl.core import SamplingParams

    llm = LLM(device=args.device, max_running_req=args.num_requests)
    n, half = args.num_requests, args.num_requests // 2
    prompts = [
        llm.apply_chat_template(
            [{"role": "user", "content": f"List {50 + i} people as JSON, with their age."}]
        )
        for i in range(n)
    ]
    free = [
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    constrained = free[:half] + [
        SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=i, json_schema=json.dumps(SCHEMA)
        )
        for i in range(half, n)
    ]
    llm.generate(prompts[:4], constrained[-4:], use_tqdm=False)  # compiles the schema and warms up

    rates: dict[str, list[float]] = {"free": [], "constrained": []}
    for _ in range(args.rounds):
        for name, params in (("free", free), ("constrained", constrained)):
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o["token_ids"]) for o in outs)
            assert all(o["finish_reason"] == "length" for o in outs), "every request runs to max_tokens"
            rates[name].append(tokens / seconds)
            print(f"{name:12s} {tokens} tokens in {seconds:6.1f} s: {tokens / seconds:7.1f} tok/s")
    llm.shutdown()
    free_rate, mixed_rate = statistics.median(rates["free"]), statistics.median(rates["constrained"])
    print(f"all unconstrained:         {free_rate:7.1f} tok/s (median of {args.rounds})")
    print(f"half with a JSON schema:   {mixed_rate:7.1f} tok/s")
    print(f"constrained / free:        {mixed_rate / free_rate:.1%}")


if __name__ == "__main__":
    main()
