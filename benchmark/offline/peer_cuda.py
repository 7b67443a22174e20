"""The CUDA peer: transformers' continuous batching (paged attention over SDPA, CUDA graphs) on the same
weights and requests as minisgl.

bench.py calls `run_peer(model_dir, prompts, output_lens, temperature, top_k, top_p, min_p)`; it returns
the seconds from the first request submitted to the last one finished, warm-up (graph capture) excluded.
Sampling uses the same temperature and filters as minisgl's run, and EOS is off.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from typing import Any


def _accepted(fn: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments `fn` takes: the continuous-batching API moves between transformers releases."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _cb_config(**wanted: Any) -> Any:
    from transformers import ContinuousBatchingConfig

    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in names})


def run_peer(
    model_dir: str,
    prompts: list[list[int]],
    output_lens: list[int],
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    dtype: str = "bfloat16",
) -> float:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="paged|sdpa", device_map="cuda"
    ).eval()
    filters = dict(top_k=max(top_k, 0), top_p=top_p, min_p=min_p or None)
    sample = dict(do_sample=True, temperature=temperature, **filters) if temperature > 0 else {}
    gen = GenerationConfig(
        max_new_tokens=max(output_lens),
        eos_token_id=None,  # the manager turns a missing EOS into "never stop early"
        pad_token_id=0,
        **(sample or dict(do_sample=False)),
    )
    # room beside the KV cache for its graph warm-up, which otherwise runs out of memory and is skipped
    cb = _cb_config(use_cuda_graph=True, scheduler_type="fifo", max_memory_percent=0.7)
    ctx = model.continuous_batching_context_manager
    kwargs = _accepted(ctx, dict(generation_config=gen, continuous_batching_config=cb, block=True))
    produced = 0
    with ctx(**kwargs) as manager:
        start = time.perf_counter()
        for i, (ids, n) in enumerate(zip(prompts, output_lens)):
            manager.add_request(list(ids), request_id=f"r{i}", max_new_tokens=n)
        finished = 0
        while finished < len(prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not getattr(manager, "is_running", lambda: True)():
                    raise RuntimeError(
                        f"the transformers peer stopped after {finished} of {len(prompts)} requests"
                    )
                continue
            if result.is_finished():
                finished += 1
                produced += len(result.generated_tokens)
        seconds = time.perf_counter() - start
    del model
    torch.cuda.empty_cache()
    if produced != sum(output_lens):
        print(f"warning: the peer produced {produced} tokens, {sum(output_lens)} asked for")
    return seconds
