"""The "torch" MoE backend: the reference, and the CPU path.

Each expert that got tokens runs its two matmuls over those tokens only, and the weighted results
are added into the output rows of their tokens. Finding those tokens reads the per-expert counts on
the host, so this backend cannot run inside a CUDA graph (the "triton" backend can).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.moe.base import BaseMoeBackend


class TorchMoeBackend(BaseMoeBackend):
    def forward(
        self,
        x: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the torch MoE backend reads expert counts on the host, which a CUDA graph cannot capture; "
                "use the triton MoE backend or turn CUDA graphs off (cuda_graph_max_bs=0)"
            )
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()
        weights = topk_weights.flatten().to(x.dtype)
        # the (token, slot) pairs t * top_k + j, grouped by expert
        pairs_by_expert = flat_ids.argsort(stable=True).split(
            torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
        )
        out = torch.zeros_like(x)
        for expert, pairs in enumerate(pairs_by_expert):
            if pairs.numel() == 0:
                continue
            tokens = pairs // top_k
            gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, down[expert]) * weights[pairs, None]
            out.index_add_(0, tokens, y)
        return out
