"""transformers' static batched `generate` as a peer: one left-padded batch, run to its longest output."""

from __future__ import annotations

from typing import Any

import torch


def generate_static(model: Any, prompts: list[list[int]], new_tokens: int, **sample: Any) -> None:
    """Every prompt in one left-padded batch; exactly `new_tokens` for each (EOS does not stop it)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - len(p) :] = torch.tensor(p)
        mask[row, width - len(p) :] = 1
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=0,
            **sample,
        )
