"""Prefix cache: many requests behind one long system prompt, radix cache against the naive one, in one run.

The workload: random.seed(0), one system prompt of --system-len random tokens, then --num-requests
requests, each the system prompt plus its own random suffix of U[--min-suffix, --max-suffix] tokens,
each generating --output-len tokens (ignore_eos). Three variants run the same requests on the same
model in the same process: the naive cache, the radix cache, and the radix cache with the in-batch
prefix-sharing rule off (in_batch_prefix_share=0: requests of one prefill batch do not wait for each
other's KV); the figures are output tokens/s and the prompt tokens each one computed.
    python benchmark/offline/shared_prefix.py
"""

from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

import torch


@dataclass
class Result:
    variant: str
    seconds: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    token_ids: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def computed_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def make_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    random.seed(args.seed)
    top = min(10000, vocab - 1)
    system = [random.randint(0, top) for _ in range(args.system_len)]
    suffixes = [
        [random.randint(0, top) for _ in range(random.randint(args.min_suffix, args.max_suffix))]
        for _ in range(args.num_requests)
    ]
    return [system + s for s in suffixes]


# name -> the LLM options that make it
VARIANTS: dict[str, dict[str, object]] = {
    "naive": dict(cache_type="naive"),
    "radix": dict(cache_type="radix"),
    "radix, in-batch rule off": dict(cache_type="radix", in_batch_prefix_share=0),
}


def run(args: argparse.Namespace, variant: str, prompts: list[list[int]]) -> Result:
    from minisgl import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        **VARIANTS[variant],
        max_running_req=args.max_running_req,
        max_seq_len_override=args.system_len + args.max_suffix + args.output_len + 8,
    )
    # warm-up on prompts that share nothing with the workload, so the radix cache starts it cold
    llm.generate([[7] * 16, [8] * 16], SamplingParams(max_tokens=8, ignore_eos=True))
    before = llm.cache_stats.prompt_tokens, llm.cache_stats.cached_tokens
    start = time.perf_counter()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    seconds = time.perf_counter() - start
    prompt_tokens = sum(o["prompt_tokens"] for o in outputs)
    cached_tokens = sum(o["cached_tokens"] for o in outputs)
    # the scheduler's running figures must tell the same story as the per-request ones
    assert llm.cache_stats.prompt_tokens - before[0] == prompt_tokens
    assert llm.cache_stats.cached_tokens - before[1] == cached_tokens
    llm.shutdown()
    token_ids = [o["token_ids"] for o in outputs]
    return Result(variant, seconds, sum(map(len, token_ids)), prompt_tokens, cached_tokens, token_ids)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model", default=None, help="HF folder or .gguf (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--system-len", type=int, default=300)
    p.add_argument("--min-suffix", type=int, default=16)
    p.add_argument("--max-suffix", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype",
        default=None,
        choices=["bfloat16", "float32"],
        help="default: bfloat16 on CUDA, else float32",
    )
    p.add_argument("--max-running-req", type=int, default=32)
    args = p.parse_args()
    # CPUs without bf16 instructions run float32 several times faster
    args.dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")

    from minisgl.models.config import ModelConfig
    from minisgl.utils.hf import load_hf_config, resolve_model_path

    vocab = ModelConfig.from_hf(load_hf_config(resolve_model_path(args.model))).vocab_size
    prompts = make_prompts(args, vocab)
    print(
        f"workload: {len(prompts)} requests behind one {args.system_len}-token system prompt, suffixes "
        f"U[{args.min_suffix}, {args.max_suffix}], {args.output_len} output tokens each, seed {args.seed}, "
        f"{args.dtype}"
    )
    results = [run(args, variant, prompts) for variant in VARIANTS]
    print(
        f"{'variant':<24} {'seconds':>8} {'output tok/s':>13} {'prompt tok':>11} {'computed':>9} {'cached':>7}"
    )
    for r in results:
        print(
            f"{r.variant:<24} {r.seconds:8.2f} {r.tokens_per_s:13.1f} {r.prompt_tokens:11d} "
            f"{r.computed_tokens:9d} {r.cached_tokens:7d}"
        )
    naive = results[0]
    for r in results[1:]:
        same = sum(a == b for a, b in zip(naive.token_ids, r.token_ids))
        print(
            f"{r.variant}: {1 - r.computed_tokens / naive.computed_tokens:.1%} fewer prompt tokens computed "
            f"than naive, {r.tokens_per_s / naive.tokens_per_s:.2f}x its output tokens/s; "
            f"{same}/{len(prompts)} outputs identical to naive's (greedy)"
        )


if __name__ == "__main__":
    main()
