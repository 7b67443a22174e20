"""Finding a model on disk: a Hugging Face folder, a GGUF file, or the embedded default model."""

from __future__ import annotations

import json
import os
from typing import Any

from minisgl.utils.logger import init_logger

logger = init_logger(__name__)


def resolve_model_path(model_path: str | None) -> str:
    """A Hugging Face folder for `model_path`; GGUF files (and the default model) are converted once and cached."""
    if model_path is None or (os.path.isfile(model_path) and model_path.endswith(".gguf")):
        # only GGUF needs the gguf package: a Hugging Face folder loads without it
        from minisgl.models.gguf import convert_gguf, default_model_path

        return convert_gguf(model_path if model_path is not None else default_model_path())
    if not os.path.isdir(model_path):
        raise FileNotFoundError(
            f"model {model_path!r} is neither a folder nor a .gguf file; minisgl loads local models only "
            "(a Hugging Face folder with config.json and *.safetensors, or a GGUF file)"
        )
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"{model_path} has no config.json; pass a Hugging Face model folder")
    return model_path


def load_hf_config(model_dir: str) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def load_tokenizer(model_dir: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def eos_token_ids(model_dir: str, hf_config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends generation: generation_config.json's, the config's and the tokenizer's."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in [value] if isinstance(value, int) else list(value or []):
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    gen_path = os.path.join(model_dir, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            add(json.load(f).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return ids


def chat_template_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a conversation in the model's chat template, ending with the assistant's turn."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "keys"):  # newer transformers return a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]
