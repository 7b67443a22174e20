"""The scheduler's host time in decode steps, part by part, and where it goes: timers, then cProfile.

    python benchmark/offline/host_steps.py [--model ckpt/qwen3-0.6b] [--device cuda] [--requests 256]
        [--max-tokens 64] [--page-size 1] [--skip-model] [--out DIR]

Under the overlap loop a decode step's host work (schedule and prepare step k + 1, launch it, then handle step
k's results) runs while the device computes; once it is longer than the device's step, the device waits. This
runs one generate call of `--requests` prompts of 100-300 tokens, with wall-clock timers around the host's parts
of every decode step (no profiler), prints their means a step, then runs the same call again under cProfile,
switched on only inside those parts, and prints the functions that take the most time.
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import os
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_profile import print_tables  # noqa: E402

# (owner, method, label): the host's parts of a step, outermost first
PARTS = [
    ("scheduler", "_schedule_next_batch", "schedule + prepare"),
    ("decode_manager", "schedule_next_batch", "  decode manager"),
    ("cache_manager", "allocate_paged", "  KV pages"),
    ("cache_manager", "allocate_decode_slots", "  KV pages"),  # a decode step's, with a slot a page
    ("engine", "prepare_batch", "  engine.prepare_batch"),
    ("attn_backend", "prepare_metadata", "    attention metadata"),
    ("sampler", "prepare", "    sampler.prepare"),
    ("engine", "forward_batch", "launch (forward_batch)"),
    ("scheduler", "_process_last_data", "results"),
    ("scheduler", "reply", "  reply"),
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a checkpoint folder (default: the embedded default model)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--page-size", type=int, default=1, help="KV slots a page")
    p.add_argument(
        "--skip-model",
        action="store_true",
        help="fixed logits instead of the model's forward (on a CPU: the host's parts then run as beside a GPU, "
        "without a CPU forward pass between them evicting their code and data from the caches)",
    )
    p.add_argument("--top", type=int, default=35, help="rows of each table")
    p.add_argument("--out", help="a folder for the tables")
    args = p.parse_args()
    from minisgl import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, max_running_req=args.requests, page_size=args.page_size)
    if args.skip_model:
        skip_model(llm.engine)
    rng = random.Random(0)
    top = min(llm.engine.model_config.vocab_size, 20000) - 1  # ids the model has
    prompts = [[rng.randint(10, top) for _ in range(rng.randint(100, 300))] for _ in range(args.requests)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.6, ignore_eos=True)
    owners = {
        "scheduler": llm,
        "decode_manager": llm.decode_manager,
        "cache_manager": llm.cache_manager,
        "engine": llm.engine,
        "attn_backend": llm.engine.attn_backend,
        "sampler": llm.engine.sampler,
    }
    decoding = [False]  # the step being prepared or handled is a decode step
    totals: dict[str, float] = defaultdict(float)
    prof = cProfile.Profile()
    profiling = [False]

    def timed(label: str, f: Callable[..., Any], outer: bool) -> Callable[..., Any]:
        @functools.wraps(f)
        def g(*a: Any, **k: Any) -> Any:
            if outer and f.__name__ == "_schedule_next_batch":
                decoding[0] = not llm.prefill_manager.runnable
            if outer and f.__name__ == "_process_last_data":
                decoding[0] = a[0] is not None and a[0][0].batch.is_decode
            if not decoding[0]:
                return f(*a, **k)
            if outer and profiling[0]:
                prof.enable()
            start = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                totals[label] += time.perf_counter() - start
                if outer and profiling[0]:
                    prof.disable()

        return g

    for owner, name, label in PARTS:
        obj = owners[owner]
        if not hasattr(obj, name):  # an older tree, for an A/B: the part is not there
            continue
        # instance attributes: each wrapper sees the bound method, the class stays as it is
        setattr(obj, name, timed(label, getattr(obj, name), not label.startswith(" ")))

    steps = [0]
    schedule = llm._schedule_next_batch

    def count() -> Any:
        out = schedule()
        steps[0] += decoding[0] and out is not None
        return out

    llm._schedule_next_batch = count
    llm.generate(prompts, params, use_tqdm=False)  # a first call: compilation and warm caches
    totals.clear()
    steps[0] = 0
    llm.generate(prompts, params, use_tqdm=False)
    n = max(steps[0], 1)
    print(f"{args.requests} requests, {n} decode steps; host time a decode step, wall clock, no profiler:")
    for label in dict.fromkeys(label for _, _, label in PARTS):
        print(f"  {label:28s} {totals[label] / n * 1e6:8.0f} us")
    profiling[0] = True
    llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    print_tables(prof, args.top, args.out, "host_steps")


def skip_model(engine: Any) -> None:
    """engine.forward_model gives the same random logits every step (the sampler, the token write and
    everything around them still run)."""
    import torch

    vocab = engine.model_config.vocab_size
    logits = torch.randn(
        (engine.config.max_running_req + 1, vocab), generator=torch.Generator().manual_seed(0)
    )
    logits = logits.to(engine.device)

    def forward_model(forward_input: Any) -> torch.Tensor:
        batch = forward_input.batch
        batch.input_ids = engine.token_pool[forward_input.input_mapping]
        rows = batch.size if batch.is_decode else batch.last_indices.shape[0]
        return logits[:rows]

    engine.forward_model = forward_model
    engine.fused_head = None  # every step through the stub and the sampler, none through the fused LM head


if __name__ == "__main__":
    main()
