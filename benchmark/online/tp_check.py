"""Greedy completions of a tiny random model through `python -m minisgl` at tp=N must equal tp=1's.

    python benchmark/online/tp_check.py --tp-size 4
Exits 1 (and says which prompt differs) when they do not. float32, so that the ranks' partial sums
do not flip a greedy token; the model has N KV heads so that it shards at any N up to 8.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests"))

from servers import started_servers  # noqa: E402
from sse import request  # noqa: E402


async def _completion(base_url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    async for status, answer in request(f"{base_url}/v1/completions", body):
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {answer}")
        return json.loads(answer)["choices"][0]["token_ids"]
    raise ConnectionError("no answer")


def greedy_tokens(
    folder: str, tp: int, prompts: list[list[int]], max_tokens: int, log: str
) -> list[list[int]]:
    args = argparse.Namespace(
        base_url=None,
        servers="minisgl",
        minisgl_args=f"--model {folder} --tp-size {tp} --dtype float32 --max-running-req 8",
        server_log=log,
        startup_timeout=300,
    )
    with started_servers(args, folder) as (target,):
        return [asyncio.run(_completion(target.base_url, target.model, p, max_tokens)) for p in prompts]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tp-size", type=int, required=True)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument(
        "--log", default=os.path.join(tempfile.gettempdir(), "tp_check"), help="server output: PATH.tpN"
    )
    args = p.parse_args()
    from tiny import build_model, random_prompts

    n = args.tp_size
    folder = build_model(
        tempfile.mkdtemp(), "llama", num_attention_heads=max(4, n), num_key_value_heads=max(2, n)
    )
    prompts = random_prompts(args.prompts, seed=1, min_len=4, max_len=30)
    ref = greedy_tokens(folder, 1, prompts, args.max_tokens, f"{args.log}.tp1")
    got = greedy_tokens(folder, n, prompts, args.max_tokens, f"{args.log}.tp{n}")
    for i, (a, b) in enumerate(zip(ref, got, strict=True)):
        print(f"prompt {i}: tp=1 {a}\n          tp={n} {b}  {'same' if a == b else 'DIFFERENT'}")
    if ref != got:
        sys.exit(1)
    print(f"tp={n} greedy completions equal tp=1's on {len(prompts)} prompts of a tiny llama")


if __name__ == "__main__":
    main()
