"""`python -m minisgl generate`: offline completions from the command line.

Prompts come from the arguments or, piped in, from stdin (one a line). Each completion goes to
stdout under a one-line header; the progress bar, errors and the summary go to stderr. The exit
code is 1 when a prompt failed, and 130 after Ctrl-C, once the completions that had finished are
printed. Arguments are parsed, and the model looked for, before torch is imported.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from minisgl.utils.cli import EXIT_ERROR, EXIT_INTERRUPTED, ArgumentParser, CommandError, debug_enabled
from minisgl.utils.hf import find_model

HEADER_CHARS = 72  # a prompt is shown by its start, on one line


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m minisgl generate",
        description="Complete prompts offline (no server): each completion is printed to stdout; "
        "progress, errors and a summary go to stderr. MINISGL_LOG_LEVEL=debug shows tracebacks.",
    )
    p.add_argument(
        "prompts",
        nargs="*",
        metavar="PROMPT",
        help="prompts to complete (default: stdin, one prompt a line, when it is not a terminal)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model folder or a .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the model's chat template (default: off)",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar and no summary line (default: both; the bar only in a terminal)",
    )
    sampling = p.add_argument_group("sampling")
    sampling.add_argument(
        "--max-tokens", type=int, default=128, help="most tokens generated per prompt (default: %(default)s)"
    )
    sampling.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: %(default)s)")
    sampling.add_argument(
        "--top-k",
        type=int,
        default=-1,
        help="sample among the k likeliest tokens; -1: all (default: %(default)s)",
    )
    sampling.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="sample among the likeliest tokens whose probabilities add up to p (default: %(default)s)",
    )
    sampling.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="drop tokens less likely than min-p times the likeliest one (default: %(default)s)",
    )
    sampling.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the sampling noise, for repeatable samples (default: random)",
    )
    sampling.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a string that ends the completion; repeatable (default: none)",
    )
    sampling.add_argument(
        "--ignore-eos", action="store_true", help="go on past the end-of-sequence token (default: off)"
    )
    engine = p.add_argument_group("engine")
    engine.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="weights and activations; auto: bfloat16 on CUDA and on CPUs with bfloat16 hardware, "
        "else float32 (default: %(default)s)",
    )
    engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    engine.add_argument(
        "--max-running-req", type=int, default=256, help="requests decoded at once (default: %(default)s)"
    )
    engine.add_argument(
        "--cache-type",
        default="radix",
        choices=["radix", "naive"],
        help="prefix cache; naive: none (default: %(default)s)",
    )
    engine.add_argument("--page-size", type=int, default=1, help="tokens per KV page (default: %(default)s)")
    engine.add_argument("--max-seq-len", type=int, default=None, help="context length (default: the model's)")
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prompts = args.prompts or _stdin_prompts()
    find_model(args.model)  # a missing model fails now, not after seconds of imports

    from minisgl.core import SamplingParams

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
        parser.error(str(e))
    if not debug_enabled():
        # a refused prompt is reported with the outputs; the scheduler's warning would say it a second time
        logging.getLogger("minisgl.scheduler").setLevel(logging.ERROR)

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
        return _generate(llm, args, prompts, params)
    finally:
        llm.shutdown()


def _stdin_prompts() -> list[str]:
    if sys.stdin is None or sys.stdin.isatty():
        # reading a terminal would wait, silently, for input the user does not know is expected
        raise CommandError(
            'no prompts: pass them as arguments (python -m minisgl generate "Once upon a time,") '
            "or pipe them in, one a line"
        )
    prompts = [line.rstrip("\n") for line in sys.stdin if line.strip()]
    if not prompts:
        raise CommandError("no prompts: stdin had none; pass them as arguments or pipe them in, one a line")
    return prompts


def _generate(llm: Any, args: argparse.Namespace, prompts: list[str], params: Any) -> int:
    from minisgl.llm import GenerationInterrupted

    use_tqdm = False if args.quiet else None
    start = time.perf_counter()
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm)
        else:
            outputs = llm.generate(prompts, params, use_tqdm)
    except GenerationInterrupted as e:
        _print_outputs(prompts, e.outputs)
        print(f"interrupted: {e.num_finished} of {_count(len(prompts), 'prompt')} finished", file=sys.stderr)
        return EXIT_INTERRUPTED
    elapsed = time.perf_counter() - start
    failed = _print_outputs(prompts, outputs)
    if not args.quiet:
        total = sum(len(o["token_ids"]) for o in outputs)
        print(
            f"{_count(len(prompts), 'prompt')}, {_count(total, 'token')} in {elapsed:.2f} s "
            f"({total / elapsed:.1f} tokens/s)",
            file=sys.stderr,
        )
    return EXIT_ERROR if failed else 0


def _print_outputs(prompts: list[str], outputs: list[dict[str, Any]]) -> int:
    """Print every output that finished (an aborted one has not); the number that failed."""
    failed = 0
    for i, (prompt, out) in enumerate(zip(prompts, outputs), 1):
        if out["finish_reason"] == "abort":
            continue
        if out["error"]:
            failed += 1
            print(f"error: prompt {i} ({_header(prompt)}): {out['error']}", file=sys.stderr)
            continue
        print(f"### {_header(prompt)}")
        print(out["text"])
        print(
            f"[finish_reason={out['finish_reason']}, {_count(len(out['token_ids']), 'token')}]\n", flush=True
        )
    return failed


def _header(prompt: str) -> str:
    """The prompt on one line, cut to its start: a long prompt is not echoed whole."""
    line = " ".join(prompt.split())
    return line if len(line) <= HEADER_CHARS else line[: HEADER_CHARS - 3] + "..."


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"
