"""Qwen3: the Llama decoder with RMSNorm over each query and key head."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
