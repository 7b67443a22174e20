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
from dataclasses import fields
from typing import Any, get_args, get_origin, get_type_hints

from minisgl.params import SamplingParams
from minisgl.utils.cli import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    ArgumentParser,
    CommandError,
    add_no_prefix_cache,
    debug_enabled,
)
from minisgl.utils.hf import find_model, read_chat_template
from minisgl.utils.kv_cache_dtype import KV_CACHE_DTYPES
from minisgl.utils.quantization import QUANTIZATIONS

HEADER_CHARS = 72  # a prompt is shown by its start, on one line
# where the command line differs from SamplingParams: a shorter default, and no logprobs to print
_DEFAULTS = {"max_tokens": 128}
_LEFT_OUT = {"logprobs", "prompt_logprobs"}


def _sampling_fields() -> list[str]:
    return [f.name for f in fields(SamplingParams) if f.name not in _LEFT_OUT]


def _add_sampling_options(group: Any) -> None:
    """One option per SamplingParams field, with its help and default from the field itself."""
    hints = get_type_hints(SamplingParams)
    for f in fields(SamplingParams):
        if f.name in _LEFT_OUT:
            continue
        flag, text, kind = "--" + f.name.replace("_", "-"), f.metadata["help"], hints[f.name]
        if kind is bool and f.default:  # on unless --no-... turns it off
            group.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=True, help=f"{text} (default: on)"
            )
        elif kind is bool:
            group.add_argument(flag, action="store_true", help=f"{text} (default: off)")
        elif get_origin(kind) is dict:
            group.add_argument(
                flag,
                action="append",
                type=_id_and_value,
                default=[],
                metavar="ID=VALUE",
                help=f"{text}; repeatable (default: none)",
            )
        elif get_origin(_listed(kind)) is list:
            item = get_args(_listed(kind))[0]
            group.add_argument(
                flag, action="append", type=item, default=[], help=f"{text}; repeatable (default: none)"
            )
        else:
            scalar = next(t for t in (int, float, str) if t is kind or t in get_args(kind))
            default = _DEFAULTS.get(f.name, f.default)
            group.add_argument(flag, type=scalar, default=default, help=f"{text} (default: %(default)s)")


def _listed(kind: Any) -> Any:
    """A list type as it is, or the list of an optional list (`list[int] | None`, whose option left out is None)."""
    lists = [k for k in get_args(kind) if get_origin(k) is list]
    return lists[0] if lists and type(None) in get_args(kind) else kind


def _id_and_value(text: str) -> tuple[int, float]:
    """ID=VALUE, e.g. 42=-100 for --logit-bias."""
    token, sep, value = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not ID=VALUE (e.g. 42=-100)") from None


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
        "--model-path",
        default=None,
        help="a Hugging Face model folder or a .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the model's chat template (default: off)",
    )
    p.add_argument(
        "--chat-template",
        metavar="FILE_OR_TEXT",
        help="with --chat, this chat template instead of the model's: a Jinja file's path, or the template's text "
        "(default: the model's)",
    )
    p.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        help="no progress bar and no summary line (default: both; the bar only in a terminal)",
    )
    _add_sampling_options(p.add_argument_group("sampling"))
    engine = p.add_argument_group("engine")
    engine.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32", "float16"],
        help="weights and activations; auto: bfloat16 on CUDA; on a CPU whichever of the "
        "two multiplies faster there, timed at start (default: %(default)s)",
    )
    engine.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="quantization on the CPU: int8 (weights per channel, any checkpoint), w8a8 (the same int8 "
        "weights times activations quantized to int8 per token), gguf (a GGUF "
        "file's own 4-bit/8-bit packing), none (float weights); auto: a GGUF file's packing beside the "
        "float weights where it measures faster (default: %(default)s)",
    )
    engine.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=KV_CACHE_DTYPES,
        help="what the KV cache stores: bf16/bfloat16, or fp8/fp8_e4m3 (FP8 with a scale per layer, "
        "read from the checkpoint's k_scale/v_scale or 1.0; half the memory of bf16, for GPUs); "
        "auto: the model's dtype (default: %(default)s)",
    )
    engine.add_argument("--device", default=None, help="cpu or cuda (default: cuda where there is one)")
    # SGLang's and vLLM's names too, as the server takes them
    engine.add_argument(
        "--max-running-req",
        "--max-running-requests",
        "--max-num-seqs",
        type=int,
        default=256,
        help="requests decoded at once (default: %(default)s)",
    )
    engine.add_argument(
        "--cache-type",
        default="radix",
        choices=["radix", "naive"],
        help="prefix cache; naive: none (default: %(default)s)",
    )
    add_no_prefix_cache(engine)
    engine.add_argument(
        "--page-size", "--block-size", type=int, default=1, help="tokens per KV page (default: %(default)s)"
    )
    engine.add_argument(
        "--max-seq-len",
        "--context-length",
        "--max-model-len",
        type=int,
        default=None,
        help="context length (default: the model's)",
    )
    engine.add_argument(
        "--tp-size",
        "--tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="tensor-parallel ranks, one GPU each (default: %(default)s)",
    )
    return p


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prompts = args.prompts or _stdin_prompts()
    find_model(args.model)  # a missing model fails now, not after seconds of imports

    values = {name: getattr(args, name) for name in _sampling_fields()}
    values["logit_bias"] = dict(values["logit_bias"])
    values["allowed_token_ids"] = values["allowed_token_ids"] or None  # none given: every token
    params = SamplingParams(**values)
    try:
        params.validate()
    except ValueError as e:
        parser.error(str(e))
    if args.chat_template is not None:
        if not args.chat:
            parser.error("--chat-template is the template of --chat; add --chat, or leave it out")
        try:
            args.chat_template = read_chat_template(args.chat_template)
        except ValueError as e:
            parser.error(f"--chat-template: {e}")
    if not debug_enabled():
        # a refused prompt is reported with the outputs; the scheduler's warning would say it a second time
        logging.getLogger("minisgl.scheduler").setLevel(logging.ERROR)

    from minisgl.llm import LLM

    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        device=args.device,
        max_running_req=args.max_running_req,
        cache_type=args.cache_type,
        page_size=args.page_size,
        max_seq_len_override=args.max_seq_len,
        tp_size=args.tp_size,
        chat_template=args.chat_template,
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
    # a prompt's n completions come in a row: each printed under its prompt
    shown = [p for p in prompts for _ in range(params.n)]
    start = time.perf_counter()
    try:
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm)
        else:
            outputs = llm.generate(prompts, params, use_tqdm)
    except GenerationInterrupted as e:
        _print_outputs(shown, e.outputs)
        what = _count(len(shown), "prompt" if params.n == 1 else "completion")
        print(f"interrupted: {e.num_finished} of {what} finished", file=sys.stderr)
        return EXIT_INTERRUPTED
    elapsed = time.perf_counter() - start
    failed = _print_outputs(shown, outputs)
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
