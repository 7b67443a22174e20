"""Qwen3: the Llama decoder with RMSNorm over each query and key head (set by ModelConfig.qk_norm)."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
