"""`python -m minisgl generate`: offline completions from the command line."""

from __future__ import annotations

import argparse
import sys
import time

from minisgl.core import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minisgl generate",
        description="Generate completions offline (no server). Prompts come from the arguments or, with none, stdin (one per line).",
    )
    p.add_argument("prompts", nargs="*", help="prompts to complete")
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the model's chat template"
    )
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    p.add_argument("--max-running-req", type=int, default=256)
    p.add_argument("--cache-type", default="radix", choices=["radix", "naive"])
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--max-seq-len", type=int, default=None)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    prompts = args.prompts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        sys.exit("no prompts: pass them as arguments or on stdin, one per line")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    try:
        params.validate()
    except ValueError as e:
        sys.exit(f"error: {e}")
    from minisgl.llm import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_running_req=args.max_running_req,
        cache_type=args.cache_type,
        page_size=args.page_size,
        max_seq_len_override=args.max_seq_len,
    )
    try:
        start = time.perf_counter()
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
        else:
            outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        for prompt, out in zip(prompts, outputs):
            print(f"### {prompt}")
            if out["error"]:
                print(f"[error] {out['error']}")
            else:
                print(out["text"])
            print(f"[finish_reason={out['finish_reason']}, {len(out['token_ids'])} tokens]\n")
        total = sum(len(o["token_ids"]) for o in outputs)
        print(f"{len(prompts)} prompts, {total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)")
    finally:
        llm.shutdown()
