"""Qwen2: the Llama decoder with a bias on the q/k/v projections."""

from __future__ import annotations

from minisgl.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    attention_bias = True
