"""Random-weight checkpoints of real model shapes, built from a config dict (no hub, no downloads).

    python benchmark/offline/random_checkpoint.py qwen3-0.6b /tmp/qwen3-0.6b
The weights are drawn on the GPU where there is one (an 8B model takes seconds there, minutes on a
CPU) and saved in bf16 with a tokenizer that has one word for every id of the vocabulary ("w1234"),
so `LLM(folder)` and transformers load it, and every generated token is text: a server streams a
chunk for each, as it does for a real model (with a small byte-level tokenizer most random ids
decode to nothing, and a server measured on them would skip most of its output path).
`--layers N` builds fewer layers than the real shape; say so beside any figure it gives.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

# what the Qwen3 family's larger shapes share, and the expert layout of its MoE models
_QWEN3: dict[str, Any] = dict(
    vocab_size=151936, head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6
)
_EXPERTS_128_TOP8: dict[str, Any] = dict(
    num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1
)

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3-0.6b": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
            rope_theta=1000000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        ),
    ),
    "llama3-8b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3-30B-A3B's shape: 128 experts of which 8 are routed per token, every layer sparse
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            **_QWEN3,
            **_EXPERTS_128_TOP8,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3-32B's shape: dense, 64 layers, untied LM head
    "qwen3-32b": (
        "qwen3",
        dict(
            **_QWEN3,
            hidden_size=5120,
            intermediate_size=25600,
            num_hidden_layers=64,
            num_attention_heads=64,
            num_key_value_heads=8,
            tie_word_embeddings=False,
        ),
    ),
    # Qwen3-235B-A22B's shape: 94 sparse layers of 128 experts, 8 routed per token (470 GB in bf16:
    # build it with --layers)
    "qwen3-235b-a22b": (
        "qwen3_moe",
        dict(
            **_QWEN3,
            **_EXPERTS_128_TOP8,
            hidden_size=4096,
            intermediate_size=12288,
            moe_intermediate_size=1536,
            num_hidden_layers=94,
            num_attention_heads=64,
            num_key_value_heads=4,
            tie_word_embeddings=False,
        ),
    ),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_vocab_tokenizer(folder: str, vocab_size: int) -> Any:
    """A tokenizer with a word for each id: three special tokens, then "w3" ... "w{vocab_size - 1}",
    split on spaces, decoded with a space between words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build(shape: str, folder: str, seed: int = 0, layers: int | None = None) -> str:
    """Save a random bf16 checkpoint of `shape` (a key of SHAPES) into `folder`, unless one is there."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    arch, kwargs = SHAPES[shape]
    if layers is not None:
        kwargs = {**kwargs, "num_hidden_layers": layers}
    os.makedirs(folder, exist_ok=True)
    tok = build_vocab_tokenizer(folder, kwargs["vocab_size"])
    config = {"qwen3": Qwen3Config, "llama": LlamaConfig, "qwen3_moe": Qwen3MoeConfig}[arch](
        **kwargs, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id
    )
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape", choices=sorted(SHAPES))
    p.add_argument("folder")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the real shape (say so)")
    args = p.parse_args()
    start = time.perf_counter()
    build(args.shape, args.folder, layers=args.layers)
    layers = SHAPES[args.shape][1]["num_hidden_layers"]
    fewer = f", {args.layers} of its {layers} layers" if args.layers is not None else ""
    print(f"{args.shape} checkpoint{fewer} in {args.folder} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()
