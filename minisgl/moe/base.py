"""The interface every MoE backend implements, and the top-k routing they all share."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class BaseMoeBackend(ABC):
    @abstractmethod
    def forward(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """Each token's routed experts, weighted and summed.

        y[t] = sum_j topk_weights[t, j] * down[e] @ (silu(gate[e] @ x[t]) * (up[e] @ x[t])), e = topk_ids[t, j].
        x: [T, H]; gate_up: [E, 2I, H] (each expert's gate rows, then its up rows); down: [E, H, I];
        topk_weights: [T, k] float32; topk_ids: [T, k] int64 -> [T, H] in x's dtype.
        """


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts in float32, the top_k of them, rescaled to sum to one when `renormalize`.

    Returns (weights [T, k] float32, expert ids [T, k] int64), as Qwen3-MoE's router computes them.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids
