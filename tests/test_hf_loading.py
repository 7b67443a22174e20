"""A model folder's config and tokenizer as the engine loads them (minisgl/utils/hf.py): a config.json that writes
out all the engine reads is taken as written, a Llama model's generic fast tokenizer through its own class, both
without transformers' Auto* imports; each gives what AutoConfig and AutoTokenizer give.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from tiny import VARIANTS

from minisgl.models.config import ModelConfig
from minisgl.utils.hf import eos_token_ids, load_hf_config, load_tokenizer, resolve_model_path

TEXT = "<|im_start|>user\nhello <|im_end|> world, naïve café\n"


def _auto(folder: str) -> tuple[object, object]:
    from transformers import AutoConfig, AutoTokenizer

    return AutoConfig.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def _same_as_auto(folder: str, written: bool = True) -> None:
    auto_config, auto_tokenizer = _auto(folder)
    config, tokenizer = load_hf_config(folder), load_tokenizer(folder)
    assert isinstance(config, SimpleNamespace) == written  # taken as written, or through AutoConfig
    assert ModelConfig.from_hf(config) == ModelConfig.from_hf(auto_config)
    assert eos_token_ids(folder, config, tokenizer) == eos_token_ids(folder, auto_config, auto_tokenizer)
    assert type(tokenizer) is type(auto_tokenizer)  # Qwen2's tokenizer class too (through AutoTokenizer)
    assert tokenizer(TEXT).input_ids == auto_tokenizer(TEXT).input_ids
    ids = tokenizer(TEXT).input_ids
    assert tokenizer.decode(ids) == auto_tokenizer.decode(ids) and tokenizer.all_special_ids == (
        auto_tokenizer.all_special_ids
    )
    messages = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(messages, tokenize=False) == auto_tokenizer.apply_chat_template(
        messages, tokenize=False
    )


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_tiny_model_loads_as_transformers_auto_classes_load_it(
    variant: str, tiny_model: Callable[[str], str]
) -> None:
    # MoE configs go through AutoConfig (transformers writes num_experts as num_local_experts)
    _same_as_auto(tiny_model(variant), written=VARIANTS[variant][0] != "qwen3_moe")


def test_the_default_model_loads_as_transformers_auto_classes_load_it_without_their_imports() -> None:
    folder = resolve_model_path(None)
    _same_as_auto(folder)
    # in a fresh process: neither load imports a model family's modules (AutoConfig's and AutoTokenizer's cost)
    code = (
        "import sys\n"
        "from minisgl.utils.hf import load_hf_config, load_tokenizer\n"
        f"load_hf_config({folder!r}); load_tokenizer({folder!r})\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def _with_config(tmp_path: object, folder: str, change: Callable[[dict], None]) -> str:
    """A copy of `folder`'s config.json (only), changed."""
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    change(cfg)
    target = os.path.join(str(tmp_path), "model")
    os.makedirs(target, exist_ok=True)
    with open(os.path.join(target, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    return target


def test_a_config_that_leaves_values_to_transformers_goes_through_auto_config(
    tmp_path: object, tiny_model: Callable[[str], str]
) -> None:
    from transformers import AutoConfig

    def drop(key: str) -> Callable[[dict], None]:
        return lambda cfg: cfg.pop(key)

    def legacy_rope(cfg: dict) -> None:  # rope settings as older transformers wrote them
        cfg.pop("rope_parameters", None)
        cfg.update(rope_theta=500000.0, rope_scaling={"type": "linear", "factor": 2.0})

    cases = [
        ("qwen3", drop("head_dim")),  # Qwen3's class default (128), not hidden / heads
        ("qwen3", drop("use_sliding_window")),
        ("mistral", drop("sliding_window")),  # Mistral's class default (4096), not none
        ("llama", drop("max_position_embeddings")),
        ("llama", legacy_rope),
        ("llama", drop("eos_token_id")),
    ]
    for i, (variant, change) in enumerate(cases):
        folder = _with_config(os.path.join(str(tmp_path), str(i)), tiny_model(variant), change)
        config = load_hf_config(folder)
        assert not isinstance(config, SimpleNamespace), (variant, i)
        assert ModelConfig.from_hf(config) == ModelConfig.from_hf(AutoConfig.from_pretrained(folder))
    # a model type the engine does not read itself: AutoConfig, whatever it writes
    other = _with_config(
        os.path.join(str(tmp_path), "other"), tiny_model("llama"), lambda c: c.update(model_type="olmo")
    )
    assert not isinstance(load_hf_config(other), SimpleNamespace)
