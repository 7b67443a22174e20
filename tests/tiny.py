"""Tiny random checkpoints built at test time, and transformers' greedy tokens as the reference."""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from minisgl.core import Batch
    from minisgl.llm import LLM

VOCAB = 320
CORPUS = [
    "The capital of France is Paris. The capital of Italy is Rome.",
    "List three prime numbers: 2, 3, 5. def fibonacci(n): return n if n < 2 else fibonacci(n - 1)",
    "Once upon a time, there was a small engine that served many requests at once.",
    "1 + 1 = 2, 2 + 2 = 4; hello world! <|im_start|> <|im_end|>",
]


def build_tokenizer(folder: str, think_tags: bool = False) -> Any:
    """A byte-level BPE tokenizer with a chat template, trained on a few sentences (no hub needed);
    `think_tags`: <think> and </think> are tokens of their own, as in Qwen3's vocabulary (added, not special)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", unk_token="<|endoftext|>"
    )
    if think_tags:
        fast.add_tokens(["<think>", "</think>"])
    # Qwen3's way to switch thinking off: a variable a request may set (chat_template_kwargs)
    fast.chat_template = (
        # a RAG template's documents (vLLM's field), as a system message first
        "{% if documents %}<|im_start|>system\n{% for d in documents %}{{ d['title'] }}: {{ d['text'] }}\n"
        "{% endfor %}<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n"
        "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
        "{% endif %}"
    )
    fast.save_pretrained(folder)
    return fast


# 8 small experts, each token routed to 2 of them
_MOE = dict(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)

# name -> (architecture, config overrides): every shape of model the tests check against transformers
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),  # 4 query heads share 2 KV heads (GQA), untied LM head
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-head-dim": ("llama", dict(head_dim=32)),  # head_dim 32, not hidden 64 / 4 heads
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True)),  # q/k/v biases
    "qwen3": ("qwen3", dict(head_dim=16)),  # RMSNorm over each q/k head
    "qwen3-mqa-head-dim": ("qwen3", dict(head_dim=24, num_key_value_heads=1, tie_word_embeddings=True)),
    "mistral": ("mistral", dict(head_dim=8)),
    # head dim 128, the CUDA decode kernels' (minisgl/kernel/cuda/decode.py): 2, 1 and 4 query heads a KV head
    "qwen3-head-dim-128": ("qwen3", dict(head_dim=128)),
    "llama-head-dim-128-mha": ("llama", dict(head_dim=128, num_key_value_heads=4)),
    "llama-head-dim-128-gqa4": ("llama", dict(head_dim=128, num_key_value_heads=1)),
    "llama-think": ("llama", dict(think_tags=True)),  # <think> and </think> one token each
    "qwen3-moe": ("qwen3_moe", dict(_MOE, norm_topk_prob=True)),  # top-2 weights rescaled to sum to one
    "qwen3-moe-unnormalised": ("qwen3_moe", dict(_MOE, norm_topk_prob=False)),
    # layers 0 and 2 dense by decoder_sparse_step, layer 3 dense by mlp_only_layers: only layer 1 has experts
    "qwen3-moe-mixed": (
        "qwen3_moe",
        dict(_MOE, norm_topk_prob=True, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]),
    ),
}


def build_variant(folder: str, name: str) -> str:
    """Save the tiny model VARIANTS[name] into `folder`."""
    arch, overrides = VARIANTS[name]
    return build_model(folder, arch, **overrides)


def random_prompts(n: int, seed: int = 0, min_len: int = 1, max_len: int = 40) -> list[list[int]]:
    """`n` prompts of random token ids (no special tokens), of lengths spread over [min_len, max_len]."""
    gen = random.Random(seed)
    return [[gen.randrange(3, VOCAB - 20) for _ in range(gen.randint(min_len, max_len))] for _ in range(n)]


def build_model(folder: str, arch: str = "llama", seed: int = 0, **overrides: Any) -> str:
    """Save a tiny random model of `arch` (llama, qwen2, qwen3, qwen3_moe, mistral) with a tokenizer into `folder`."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        MistralConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    if os.path.isfile(os.path.join(folder, "config.json")):
        return folder
    classes = {
        "llama": LlamaConfig,
        "qwen2": Qwen2Config,
        "qwen3": Qwen3Config,
        "qwen3_moe": Qwen3MoeConfig,
        "mistral": MistralConfig,
    }
    tok = build_tokenizer(folder, think_tags=overrides.pop("think_tags", False))
    kwargs: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    config = classes[arch](**kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1:  # random init is small; widen it so greedy tokens are not near-ties
                p.normal_(0, 0.2)
            elif name.endswith("bias"):  # zero at init, which would hide a bias that is never added
                p.normal_(0, 0.2)
            else:  # norm weights are ones at init, which would hide a norm read from the wrong place
                p.normal_(1, 0.1)
    model.save_pretrained(folder)
    return folder


def hf_greedy(
    folder: str, prompts: list[list[int]], max_new_tokens: int, **generate_kwargs: Any
) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, one prompt at a time, never stopping early.

    `generate_kwargs` go to `generate` (a repetition_penalty, a logits_processor ...).
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    out = []
    for ids in prompts:
        x = torch.tensor([ids])
        y = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            **generate_kwargs,
        )
        out.append(y[0, len(ids) :].tolist())
    return out


def assert_nothing_held(llm: LLM) -> None:
    """After a generate call every table row is free again and every KV page is free or cached."""
    assert llm.table_manager.available_size == llm.table_manager.max_running_req
    llm.check_integrity()


def mixed_steps(llm: LLM) -> list[int]:
    """Watch `llm`'s steps: each step's count of decode rows inside a prefill step is appended to the list."""
    from minisgl.attention.cpu_backend import CpuPrefillMetadata
    from minisgl.attention.triton_backend import TritonAttnMetadata

    seen: list[int] = []

    def observe(batch: Batch | None) -> None:
        if batch is not None and batch.is_prefill:
            decoding = sum(r.cached_len >= r.prompt_len for r in batch.reqs)
            seen.append(decoding)
            # the CPU backend runs them with its decode kernel, the prompts' rows before them with its prefill one
            meta = batch.attn_metadata
            # the CUDA path's backend as well, where the step does not replay a prefill graph, unless it is told to
            # send them with the prompts to its extend kernel (MINISGL_MIXED_DECODE_SPLIT=0)
            split = llm.engine.attn_backend.splits_mixed_steps
            if isinstance(meta, CpuPrefillMetadata) or (
                isinstance(meta, TritonAttnMetadata) and not batch.padded_tokens
            ):
                assert (0 if meta.decode is None else meta.decode.rows.shape[0]) == (decoding if split else 0)

    llm.step_observers.append(observe)
    return seen


def overlap_loop_llm(folder: str, **kwargs: Any) -> LLM:
    """An LLM whose scheduler runs the overlap loop (which runs on CUDA) on the CPU."""
    from minisgl.llm import LLM

    class OverlapLLM(LLM):
        def run_forever(self) -> None:
            last = None
            while True:
                last = self.overlap_loop(last)

    return OverlapLLM(folder, **kwargs)


QUANT_PROMPTS = [[5, 9, 14, 3], [40, 41, 42], [7] * 9, [100, 7, 3, 55, 21]]


def float_and_quantized_tokens(
    make_llm: Any, folder: str, dtype: str, quantization: str
) -> tuple[list[list[int]], list[list[int]], LLM]:
    """8 greedy tokens of each of QUANT_PROMPTS from the float model, then from the quantized one (returned)."""
    from minisgl.core import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    reference = make_llm(folder, dtype=dtype)
    floats = [o["token_ids"] for o in reference.generate(QUANT_PROMPTS, params)]
    reference.shutdown()
    quantized = make_llm(folder, dtype=dtype, quantization=quantization)
    return floats, [o["token_ids"] for o in quantized.generate(QUANT_PROMPTS, params)], quantized
