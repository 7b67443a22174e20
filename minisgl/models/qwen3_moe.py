"""Qwen3-MoE: the Qwen3 decoder whose sparse layers route each token to top-k of many small experts."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.distributed import all_reduce
from minisgl.layers.linear import LinearReplicated
from minisgl.layers.moe import MoeExperts
from minisgl.models.config import ModelConfig
from minisgl.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config: ModelConfig, layer_id: int) -> bool:
    """transformers' rule for which Qwen3-MoE layers have experts; the others have the dense MLP."""
    return (
        layer_id not in config.mlp_only_layers
        and config.num_experts > 0
        and (layer_id + 1) % config.decoder_sparse_step == 0
    )


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act={config.hidden_act!r} is not supported; only silu")
        # replicated: the router is small, and every rank must route every token alike without a collective
        self.gate = LinearReplicated(config.hidden_size, config.num_experts)
        self.experts = MoeExperts(
            config.num_experts,
            config.hidden_size,
            config.moe_intermediate_size,
            config.num_experts_per_tok,
            config.norm_topk_prob,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.experts(x, self.gate(x)))


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def build_mlp(config: ModelConfig, layer_id: int) -> nn.Module:
        if is_sparse_layer(config, layer_id):
            return SparseMoeBlock(config)
        return Qwen3ForCausalLM.build_mlp(config, layer_id)
