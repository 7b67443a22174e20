"""Mistral: the Llama decoder; its sliding window caps the context length the engine serves."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
