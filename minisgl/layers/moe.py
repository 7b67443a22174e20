"""The routed experts of an MoE layer, split across tensor-parallel ranks by their intermediate features.

Every rank holds every expert, but only its slice of each expert's intermediate features: rows
[rank * I_local, (rank + 1) * I_local) of gate and of up, and the matching columns of down. Like a
column-parallel then row-parallel MLP, each rank's output is then a partial sum; the caller
all-reduces it once (after adding any other partial sums of the same block).
"""

from __future__ import annotations

import torch
from torch import nn

from minisgl.distributed import get_tp_info
from minisgl.env import ENV
from minisgl.moe import create_moe_backend, select_experts


class MoeExperts(nn.Module):
    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, top_k: int, renormalize: bool
    ) -> None:
        super().__init__()
        tp = get_tp_info().size
        if intermediate_size % tp:
            raise ValueError(
                f"moe_intermediate_size {intermediate_size} does not split over {tp} tensor-parallel ranks; "
                "choose a tensor-parallel size that divides it"
            )
        self.num_experts = num_experts
        self.local_intermediate = intermediate_size // tp
        self.top_k = top_k
        self.renormalize = renormalize
        # [E, 2 * I_local, H]: each expert's gate rows, then its up rows, so one matmul computes both
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * self.local_intermediate, hidden_size), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.local_intermediate), requires_grad=False
        )
        # the parameters were created on the device the model is built on
        self.backend = create_moe_backend(ENV.MOE_BACKEND.value, self.gate_up_proj.device)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: [T, H], router_logits: [T, E] -> this rank's partial sum [T, H]."""
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize)
        return self.backend.forward(x, self.gate_up_proj, self.down_proj, weights, ids)
