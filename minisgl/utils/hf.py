"""Finding a model on disk: a Hugging Face folder, a GGUF file, or the embedded default model."""

from __future__ import annotations

import json
import os
import re
import uuid
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


# A config.json that writes out every value ModelConfig.from_hf and the EOS lookup read, for a model type whose
# transformers class would only add defaults to it, is read as it is: transformers' AutoConfig imports about a
# second of modules at every start on a 2-core machine. The keys each type must write (where its class's default
# differs from from_hf's, or is not a constant): the others, and any other type, go through AutoConfig.
_CONFIG_KEYS = (
    "architectures", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
    "num_key_value_heads", "vocab_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "hidden_act", "eos_token_id",
)  # fmt: skip
# (MoE types go through AutoConfig: transformers writes their expert count under another name, num_local_experts,
# which its attribute map reads back as num_experts)
_CONFIG_TYPES: dict[str, tuple[str, ...]] = {
    "llama": (),
    "mistral": ("sliding_window",),
    "qwen2": ("use_sliding_window",),
    "qwen3": ("head_dim", "use_sliding_window"),
}


def _written_config(model_dir: str) -> Any | None:
    """config.json as a namespace where it writes out all the engine reads (above), else None."""
    cfg = _read_json(os.path.join(model_dir, "config.json"))
    need = _CONFIG_TYPES.get(cfg.get("model_type"))
    if need is None or any(k not in cfg for k in (*_CONFIG_KEYS, *need)):
        return None
    params = cfg.get("rope_parameters")
    # rope settings as transformers >= 5 writes them, or a plain theta; older scaling entries are normalised by
    # AutoConfig (their keys differ from version to version)
    if cfg.get("rope_scaling") is not None or (params is not None and not isinstance(params, dict)):
        return None
    if (params is None or "rope_theta" not in params) and "rope_theta" not in cfg:
        return None
    from types import SimpleNamespace

    return SimpleNamespace(**cfg)


def load_hf_config(model_dir: str) -> Any:
    """The model's Hugging Face config: its config.json as written where that holds all the engine reads, else
    transformers' AutoConfig (tests/test_hf_loading.py checks both give the same ModelConfig)."""
    written = _written_config(model_dir)
    if written is not None:
        return written
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


# A Llama model whose tokenizer_config.json names transformers' generic fast tokenizer gets that class from
# AutoTokenizer (other model types may get a class of their own: Qwen2's, for one); it is taken through that class
# directly, without AutoTokenizer's imports (about a second of every start on a 2-core machine). The embedded
# default model is one.
_GENERIC_TOKENIZERS = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(model_dir: str, chat_template: str | None = None) -> Any:
    """The model's tokenizer; `chat_template` (a Jinja text, read_chat_template's) replaces its chat template."""
    generic = (
        _read_json(os.path.join(model_dir, "tokenizer_config.json")).get("tokenizer_class")
        in _GENERIC_TOKENIZERS
        and _read_json(os.path.join(model_dir, "config.json")).get("model_type") == "llama"
        and os.path.isfile(os.path.join(model_dir, "tokenizer.json"))
    )
    if generic:
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    else:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def read_chat_template(value: str) -> str:
    """A chat template given as vLLM's and SGLang's --chat-template take it: a file's path (its text), or the
    Jinja text itself. Anything else is a ValueError that says what to pass."""
    if os.path.isfile(value):
        try:
            with open(value, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"the chat template file {value!r} cannot be read as UTF-8 text: {e}") from None
    elif "{{" in value or "{%" in value:
        text = value
    else:
        raise ValueError(
            f"the chat template {value!r} is neither a file nor a Jinja template; pass the path of a .jinja file "
            "or the template's text"
        )
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        ImmutableSandboxedEnvironment().parse(text)  # a syntax error now, not at the first chat request
    except ImportError:
        pass
    except Exception as e:
        raise ValueError(f"the chat template does not parse as Jinja: {e}") from None
    if "messages" not in text:
        raise ValueError("the chat template never reads `messages`, so every conversation would be dropped")
    return text


def eos_token_ids(model_dir: str, hf_config: Any, tokenizer: Any) -> list[int]:
    """Every id that ends generation: generation_config.json's, the config's and the tokenizer's."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for v in [value] if isinstance(value, int) else list(value or []):
            if isinstance(v, int) and v not in ids:
                ids.append(v)

    add(_read_json(os.path.join(model_dir, "generation_config.json")).get("eos_token_id"))
    add(getattr(hf_config, "eos_token_id", None))
    add(getattr(tokenizer, "eos_token_id", None))
    return ids


def chat_template_ids(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    template_kwargs: dict[str, Any] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """Token ids of a conversation in the model's chat template, ending with the assistant's turn (or, as
    render_chat's flags say, without it, or inside the last message).

    Text a user writes never becomes a control token: see render_chat and chat_pieces_ids.
    """
    pieces = render_chat(
        tokenizer,
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
    )
    return chat_pieces_ids(tokenizer, pieces)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
    documents: list[dict[str, str]] | None = None,
) -> list[tuple[str, bool]]:
    """The conversation in the chat template as pieces of text, each marked whether it is a client's text (a
    message's content, or a field of one of vLLM's `documents`, which RAG templates write).

    The template is rendered with a placeholder for each content, and the contents are put back in
    the pieces it leaves: so the template's own text and the users' text are told apart however the
    template is written. (A template that edits a content, trimming it say, sees the placeholder: the
    content reaches the model as it was sent.) `continue_final_message` ends the text right after the last
    message's content, so the model continues that message. `template_kwargs`: more variables
    for the template (checked by the caller: tokenizer/template_kwargs.py).
    """
    nonce = uuid.uuid4().hex
    marked = [_marked(m, i, nonce) for i, m in enumerate(messages)]
    extra = {**(template_kwargs or {}), **({"tools": tools} if tools else {})}
    texts: list[dict[str, Any]] = list(messages)
    if documents:
        # a document's fields are placeholders too, numbered after the messages
        texts += documents
        extra["documents"] = [
            {key: f"<{nonce}:{len(messages) + j}:{key}>" for key in doc} for j, doc in enumerate(documents)
        ]
    text = tokenizer.apply_chat_template(
        marked,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
        **extra,
    )
    # re.split with one group alternates template text and "message index:field" of the text that goes there
    parts = re.split(f"<{nonce}:(\\d+:\\w+)>", text)
    out: list[tuple[str, bool]] = []
    for k, p in enumerate(parts):
        if k % 2:
            i, name = p.split(":")
            p = texts[int(i)][name]
        out.append((p, bool(k % 2)))
    return out


# a message's texts that come from the client: written by the template as plain text, never as control tokens
# (a speaker's name and an earlier answer's reasoning too, which some templates write)
_CLIENT_TEXTS = ("content", "reasoning_content", "name")


def _marked(message: dict[str, Any], i: int, nonce: str) -> dict[str, Any]:
    """The message with a placeholder for each client text (the content even when empty: the template writes it
    in its place; the others only when set, as a template may test them)."""
    out = dict(message)
    for name in _CLIENT_TEXTS:
        value = message.get(name)
        if isinstance(value, str) and (value or name == "content"):
            out[name] = f"<{nonce}:{i}:{name}>"
    return out


def chat_pieces_ids(tokenizer: Any, pieces: list[tuple[str, bool]]) -> list[int]:
    """Token ids of render_chat's pieces, where only the template's text may hold control tokens.

    The whole text is tokenized once, which gives exactly the ids of the template applied as usual
    (`apply_chat_template(tokenize=True)`). Only when a control token there comes from a content
    (a user wrote "<|im_end|>" into a message) are the pieces tokenized one by one instead: the
    template's with special tokens parsed, the contents with `split_special_tokens`, as plain text.
    """
    text = "".join(p for p, _ in pieces)
    if getattr(tokenizer, "is_fast", False):
        control = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        spans, start = [], 0
        for p, is_content in pieces:
            if is_content and p:
                spans.append((start, start + len(p)))
            start += len(p)
        if not any(
            t in control and any(s < end and e > begin for begin, end in spans)
            for t, (s, e) in zip(ids, offsets)
        ):
            return [int(t) for t in ids]
    out: list[int] = []
    for p, is_content in pieces:
        if p:
            out += tokenizer.encode(p, add_special_tokens=False, split_special_tokens=is_content)
    return [int(t) for t in out]
