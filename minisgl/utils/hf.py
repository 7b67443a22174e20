"""Finding a model on disk: a Hugging Face folder, a GGUF file, or the embedded default model."""

from __future__ import annotations

import json
import os
from typing import Any

from minisgl.utils.logger import init_logger

logger = init_logger(__name__)


def find_model(model_path: str | None) -> str:
    """The GGUF file or Hugging Face folder `model_path` names (None: the embedded default model's file).

    It only looks at the file system, so a command can check its model before loading anything; a
    model that is not there is a FileNotFoundError that says what to pass instead.
    """
    if model_path is None:
        from minisgl.models.gguf import default_model_path

        try:
            return default_model_path()
        except RuntimeError as e:  # the default model's package is missing: that is a missing file too
            raise FileNotFoundError(str(e)) from None
    what = (
        "minisgl loads local models only: pass a Hugging Face folder (config.json and *.safetensors) "
        "or a .gguf file"
    )
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"model {model_path!r} does not exist; {what}")
    if os.path.isfile(model_path):
        if not model_path.endswith(".gguf"):
            raise FileNotFoundError(f"model {model_path!r} is a file but not a .gguf file; {what}")
        return model_path
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        raise FileNotFoundError(f"model folder {model_path!r} has no config.json; {what}")
    return model_path


def resolve_model_path(model_path: str | None) -> str:
    """A Hugging Face folder for `model_path`; GGUF files (and the default model) are converted once and cached."""
    path = find_model(model_path)
    if os.path.isfile(path):
        # only GGUF needs the gguf package: a Hugging Face folder loads without it
        from minisgl.models.gguf import convert_gguf

        try:
            return convert_gguf(path)
        except ValueError as e:  # gguf's own messages ("GGUF magic invalid") do not say which file
            raise ValueError(f"cannot load {path}: {e}") from e
    return path


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
