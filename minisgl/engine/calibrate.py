"""The inputs' peaks of every linear layer over one prefill: what W8A8's smoothing is computed from.

The prefill runs through the engine's own prepare and forward (the float weights, the engine's attention
backend and pool), as the warm-up's steps do, before anything is quantized; what it wrote to the pool
and the tables is cleared after.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.layers.linear import QuantizableLinear

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine


@torch.inference_mode()
def input_peaks(engine: Engine, ids: list[int]) -> dict[str, torch.Tensor]:
    """Module name -> the largest |x[:, k]| of each input channel k over the prefill of `ids` (float32, [K])."""
    if not ids:
        raise ValueError("calibration needs at least one token")
    n = min(len(ids), engine.num_pages * engine.page_size - 1)
    peaks: dict[str, torch.Tensor] = {}

    def record(name: str):  # noqa: ANN202 - a forward pre-hook
        def hook(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            x = args[0]
            peak = x.reshape(-1, x.shape[-1]).abs().amax(dim=0).float()
            old = peaks.get(name)
            peaks[name] = peak if old is None else torch.maximum(old, peak)

        return hook

    handles = [
        m.register_forward_pre_hook(record(name))
        for name, m in engine.model.named_modules()
        if isinstance(m, QuantizableLinear)
    ]
    try:
        engine.page_table[0, : n + 1] = torch.arange(n + 1, dtype=torch.int32)
        engine.token_pool[0, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        req = Req(
            input_ids=ids[:n],
            table_idx=0,
            cached_len=0,
            output_len=1,
            uid=-1,
            # prompt logprobs make the LM head score every position, so its peaks are over all the tokens too
            sampling_params=SamplingParams(prompt_logprobs=0),
            cache_handle=None,
            seed=0,
        )
        batch = Batch(reqs=[req], phase="prefill")
        engine.forward_batch(engine.prepare_batch(batch))
    finally:
        for h in handles:
            h.remove()
        engine.page_table[0].zero_()
        engine.token_pool[0].zero_()
    return {name: p.cpu() for name, p in peaks.items()}
