"""The "triton" MoE backend: grouped GEMMs over the tokens sorted by expert (minisgl/kernel/moe.py).

Nothing in it waits for the device, so CUDA graphs capture it with the rest of the decode step.
"""

from __future__ import annotations

import torch

from minisgl.kernel.moe import fused_moe
from minisgl.moe.base import BaseMoeBackend


class TritonMoeBackend(BaseMoeBackend):
    def forward(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return fused_moe(x, gate_up, down, topk_weights, topk_ids)
