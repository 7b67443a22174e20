"""How far an FP8 KV cache moves a model's outputs: greedy agreement and logit drift, on any device.

    python benchmark/offline/fp8_agreement.py --model FOLDER          # e.g. a random_checkpoint.py one
    python benchmark/offline/fp8_agreement.py --shape qwen3-0.6b      # builds that checkpoint first
    python benchmark/offline/fp8_agreement.py                         # the embedded SmolLM2-135M

N prompts of random token ids run greedy for --steps tokens twice: with the model-dtype cache (the
reference, kv_cache_dtype="auto") and with kv_cache_dtype="fp8_e4m3". Printed:
- agreement: the share of the N x steps tokens that are equal, position by position, and the mean
  length of the prefix the two runs share;
- logit drift: max and mean |logit difference| at the steps where both runs have the same context
  (a step after the first different token has another context, and is not compared);
- the reference's top-1 minus top-2 logit margin at those steps. Random weights give near-uniform
  logits: where margins are below the drift, a different token says little about FP8 itself.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class GreedyRun:
    tokens: list[list[int]]  # each prompt's generated tokens
    logits: list[torch.Tensor]  # each prompt's [steps, vocab] float32 logits, on the CPU


@dataclass
class Agreement:
    token_rate: float  # equal tokens, position by position, over all of them
    prefix_rate: float  # mean length of the shared prefix, over the steps
    compared_steps: int  # steps with the same context in both runs
    max_logit_diff: float
    mean_logit_diff: float
    logit_std: float  # the spread of the reference's logits, for scale
    margins: list[float]  # reference top-1 minus top-2 logit at the compared steps


def greedy_run(
    model: str | None,
    kv_cache_dtype: str | torch.dtype,
    prompts: list[list[int]],
    steps: int,
    **llm_args: Any,
) -> GreedyRun:
    """Greedy tokens and the logits they were picked from, for each prompt (text or token ids), with the
    given KV cache."""
    from minisgl import LLM, SamplingParams
    from minisgl.core import ChunkedReq
    from minisgl.env import ENV

    fused = ENV.FUSED_SAMPLING.value
    ENV.FUSED_SAMPLING.value = 0  # every step's logits are recorded: the fused LM head and sampling make none
    try:
        llm = LLM(model, kv_cache_dtype=kv_cache_dtype, **llm_args)
    finally:
        ENV.FUSED_SAMPLING.value = fused
    try:
        recorded: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(prompts))}
        forward = llm.engine.forward_model

        def recording(forward_input: Any) -> torch.Tensor:
            logits = forward(forward_input)
            rows = logits[: forward_input.batch.size].float().cpu()
            for i, req in enumerate(forward_input.batch.reqs):
                # a chunk of a long prompt samples nothing
                if not isinstance(req, ChunkedReq):
                    recorded[req.uid].append(rows[i])
            return logits

        # the scheduler calls forward_model once a step; wrapping this one engine's method records each step
        llm.engine.forward_model = recording
        outputs = llm.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0.0))
    finally:
        llm.shutdown()
    tokens = [o["token_ids"] for o in outputs]
    logits = [torch.stack(recorded[i]) for i in range(len(prompts))]
    for t, lg in zip(tokens, logits):
        if len(t) != steps or lg.shape[0] != steps:
            raise RuntimeError(f"expected {steps} tokens and logit rows, got {len(t)} and {lg.shape[0]}")
    return GreedyRun(tokens, logits)


def compare(ref: GreedyRun, test: GreedyRun) -> Agreement:
    """Agreement of `test` with `ref`; logits compared at the steps whose context is the same in both."""
    total = equal = prefix = 0
    diffs: list[torch.Tensor] = []
    margins: list[float] = []
    ref_rows: list[torch.Tensor] = []
    for rt, tt, rl, tl in zip(ref.tokens, test.tokens, ref.logits, test.logits):
        total += len(rt)
        equal += sum(a == b for a, b in zip(rt, tt))
        shared = next((i for i, (a, b) in enumerate(zip(rt, tt)) if a != b), len(rt))
        prefix += shared
        # step i's logits pick token i from a context holding tokens < i: the same up to the first difference
        same = rl[: shared + 1]
        diffs.append((tl[: shared + 1] - same).abs().amax(dim=-1))
        top2 = same.topk(2, dim=-1).values
        margins += (top2[:, 0] - top2[:, 1]).tolist()
        ref_rows.append(same)
    d = torch.cat(diffs)
    return Agreement(
        token_rate=equal / total,
        prefix_rate=prefix / total,
        compared_steps=d.numel(),
        max_logit_diff=float(d.max()),
        mean_logit_diff=float(d.mean()),
        logit_std=float(torch.cat(ref_rows).std()),
        margins=margins,
    )


def random_prompts(num: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    gen = random.Random(seed)
    top = min(10000, vocab - 1)
    return [[gen.randint(0, top) for _ in range(gen.randint(min_len, max_len))] for _ in range(num)]


def report(result: Agreement, steps: int) -> str:
    margins = sorted(result.margins)
    below = sum(m < result.max_logit_diff for m in margins) / len(margins)
    return "\n".join(
        [
            f"greedy agreement over the first {steps} tokens: {100 * result.token_rate:.1f}% of tokens, "
            f"mean shared prefix {100 * result.prefix_rate:.1f}% of the steps",
            f"logit drift at {result.compared_steps} steps of the same context: max {result.max_logit_diff:.4f}, "
            f"mean of the per-step max {result.mean_logit_diff:.4f} (reference logits' std {result.logit_std:.3f})",
            f"reference top-1 minus top-2 margin: min {margins[0]:.4f}, median {statistics.median(margins):.4f}, "
            f"max {margins[-1]:.4f}; {100 * below:.1f}% of steps have a margin below the max drift",
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--model", help="a Hugging Face folder or .gguf file (default: the embedded SmolLM2-135M)"
    )
    source.add_argument("--shape", help="build a random checkpoint of this shape (random_checkpoint.py)")
    p.add_argument("--layers", type=int, default=None, help="with --shape: fewer layers (say so)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, choices=[None, "cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--attention-backend", default="auto", help="auto, cpu, torch or triton")
    args = p.parse_args()
    if args.shape is None:
        measure(args, args.model)
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from random_checkpoint import build

    with tempfile.TemporaryDirectory(prefix=f"{args.shape}-") as folder:
        measure(args, build(args.shape, folder, layers=args.layers))


def measure(args: argparse.Namespace, model: str | None) -> None:
    from minisgl.models.config import ModelConfig
    from minisgl.utils.hf import load_hf_config, resolve_model_path

    vocab = ModelConfig.from_hf(load_hf_config(resolve_model_path(model))).vocab_size
    prompts = random_prompts(args.num_prompts, vocab, args.min_len, args.max_len, args.seed)
    llm_args = dict(
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        max_running_req=args.num_prompts,
        max_seq_len_override=args.max_len + args.steps + 8,
    )
    ref = greedy_run(model, "auto", prompts, args.steps, **llm_args)
    fp8 = greedy_run(model, "fp8_e4m3", prompts, args.steps, **llm_args)
    layers = f", {args.layers} layers" if args.layers else ""
    name = args.shape or model or "SmolLM2-135M-Instruct (embedded)"
    print(f"model {name}{layers}: {len(prompts)} prompts, {args.steps} greedy steps, fp8_e4m3 vs auto")
    print(report(compare(ref, fp8), args.steps))


if __name__ == "__main__":
    main()
