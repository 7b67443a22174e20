"""The model registry: Hugging Face architecture name -> model class."""

from __future__ import annotations

from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.mistral import MistralForCausalLM
from minisgl.models.qwen2 import Qwen2ForCausalLM
from minisgl.models.qwen3 import Qwen3ForCausalLM
from minisgl.models.qwen3_moe import Qwen3MoeForCausalLM
from minisgl.utils.registry import Registry

MODELS: Registry[type[LlamaForCausalLM]] = Registry("model architecture")
MODELS.register("LlamaForCausalLM")(LlamaForCausalLM)
MODELS.register("Qwen2ForCausalLM")(Qwen2ForCausalLM)
MODELS.register("Qwen3ForCausalLM")(Qwen3ForCausalLM)
MODELS.register("Qwen3MoeForCausalLM")(Qwen3MoeForCausalLM)
MODELS.register("MistralForCausalLM")(MistralForCausalLM)


def create_model(config: ModelConfig) -> LlamaForCausalLM:
    return MODELS.get(config.architecture)(config)


__all__ = ["MODELS", "ModelConfig", "create_model"]
