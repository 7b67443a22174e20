"""The decode graphs end at the final norm, and the LM head runs after the replay: fused with the sampling
(kernel/lm_sample.py) when every row of the batch samples from the whole vocabulary, as its product otherwise.

A step of 256 rows of a 151,936-token vocabulary writes 155 MB of float32 logits that the sampling kernel reads
back; the fused kernel keeps them in registers. Rows that need the logits themselves (filters, penalties, a
logit bias or min_tokens, a grammar's mask, logprobs) take the product and the sampler as before.
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.engine.sample import BatchSamplingArgs
from minisgl.env import ENV
from minisgl.kernel import triton_available


def fused_head_possible(model: nn.Module, device: torch.device, tp_size: int) -> bool:
    """Whether `model`'s LM head can run fused with the sampling: on CUDA, one rank (a rank's vocabulary
    slice would need a merge across ranks), and a float weight (not a quantized one)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    return (
        ENV.FUSED_SAMPLING.value > 0
        and device.type == "cuda"
        and tp_size == 1
        and weight is not None
        and getattr(head, "qweight", None) is None
        and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and triton_available()
    )


def plain_rows(args: BatchSamplingArgs) -> bool:
    """Every row samples from the whole vocabulary at its temperature (or greedily), and no request asks for
    anything computed from the logits."""
    return (
        args.bias is None
        and args.token_mask is None
        and args.penalty is None
        and args.top_k is None
        and args.top_p is None
        and args.min_p is None
        and args.top_logprobs is None
        and args.prompt is None
    )


class FusedHead:
    """The LM head of a model, fused with the sampling for the decode graphs' plain batches of up to
    `max_rows` rows (MINISGL_FUSED_SAMPLING)."""

    def __init__(self, model: nn.Module, vocab_size: int, max_bs: int, device: torch.device) -> None:
        # imported here, once: the engine builds a FusedHead only where Triton is installed
        from minisgl.kernel.lm_sample import lm_head_sample

        self.kernel = lm_head_sample
        self.head = model.lm_head
        self.vocab_size = vocab_size
        self.max_rows = ENV.FUSED_SAMPLING.value
        # an all-greedy batch has no temperatures, seeds or steps on the device: zeros stand in (greedy rows
        # read no noise)
        self.zeros_f = torch.zeros(max(max_bs, 1), dtype=torch.float32, device=device)
        self.zeros_i = torch.zeros(max(max_bs, 1), dtype=torch.int64, device=device)

    def takes(self, bs: int, args: BatchSamplingArgs) -> bool:
        """Whether a decode graph's batch of `bs` rows with these arguments samples here."""
        return bs <= self.max_rows and plain_rows(args)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own last step: float32 logits of `hidden`'s rows."""
        return self.head(hidden).float()

    def sample(self, hidden: torch.Tensor, args: BatchSamplingArgs) -> torch.Tensor:
        """hidden: [B, H] final hidden rows -> the next tokens [B] int32, as the sampler would draw them from
        the logits (for plain_rows batches only)."""
        bs = hidden.shape[0]
        if args.greedy:
            temps, seeds, steps = self.zeros_f[:bs], self.zeros_i[:bs], self.zeros_i[:bs]
        else:
            assert args.temperatures is not None and args.seeds is not None and args.steps is not None
            temps, seeds, steps = args.temperatures, args.seeds, args.steps
        return self.kernel(hidden, self.head.weight, self.vocab_size, temps, seeds, steps)

    def warm(self, hidden_width: int, dtype: torch.dtype, graph_sizes: list[int]) -> None:
        """Compile the fused kernel's variants (one tile a band of batch sizes: lm_sample.default_config), and
        let cuBLAS choose the LM head's product for each graph size, which batches needing logits run after
        the replay (a row count new to a process costs the host a few hundred microseconds once)."""
        from minisgl.kernel.lm_sample import BANDS

        if not graph_sizes:
            return
        device = self.zeros_f.device
        largest = max(graph_sizes)
        hidden = torch.zeros(largest, hidden_width, dtype=dtype, device=device)
        for bs in sorted({min(b, largest) for b in BANDS if b <= self.max_rows}):
            zf, zi = self.zeros_f[:bs], self.zeros_i[:bs]
            self.kernel(hidden[:bs], self.head.weight, self.vocab_size, zf, zi, zi)
        for bs in graph_sizes:
            self.logits(hidden[:bs])
