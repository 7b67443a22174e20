"""Where W8A8 loses quality: perplexity with int8 activations on all linear layers but one kind.

    python benchmark/offline/w8a8_layers.py

transformers' float32 model of the default SmolLM2-135M (the Q4_1 file dequantized), every linear layer's
weight rounded to per-channel int8 (`Int8Weight`, the LM head's too), and the inputs of the layer kinds
named in each row rounded to int8 per token (`quantize_rows`, what w8a8 does; the LM head's input is
never rounded, as the engine's w8a8 keeps the head weight-only). Perplexity over the fixed text of
quant_quality.py. Also printed: how peaked each kind's input rows are (a row's largest magnitude over
its mean magnitude, median over tokens, mean over layers): one large value in a row coarsens the int8
step of all the others.
"""

from __future__ import annotations

import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "data", "plain_english.txt")
KINDS = {
    "q/k/v": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate/up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def main() -> None:
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    from transformers import AutoModelForCausalLM

    from minisgl import LLM
    from minisgl.layers.quant import Int8Weight, quantize_rows
    from minisgl.utils.hf import load_tokenizer

    llm = LLM(None, dtype="float32", quantization="none", device="cpu", max_running_req=2)
    folder = llm.engine.model_dir
    llm.shutdown()
    ids = torch.tensor([list(load_tokenizer(folder).encode(open(TEXT).read()))])
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    if model.config.tie_word_embeddings:
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    for m in linears.values():
        m.weight.data = Int8Weight.from_float(m.weight.data).dequantize()
    peaks: dict[str, list[float]] = {}

    def perplexity(rounded: set[str]) -> float:
        def hook(name: str):  # noqa: ANN202
            leaf = name.rpartition(".")[2]

            def round_input(_: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
                x = args[0].reshape(-1, args[0].shape[-1])
                peaks.setdefault(leaf, []).append((x.abs().amax(1) / x.abs().mean(1)).median().item())
                if leaf not in rounded:
                    return args
                q, scale = quantize_rows(x)
                return ((q.float() * scale).reshape(args[0].shape), *args[1:])

            return round_input

        handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items() if n != "lm_head"]
        with torch.inference_mode():
            loss = model(ids, labels=ids).loss.item()
        for h in handles:
            h.remove()
        return math.exp(loss)

    every = {leaf for leaves in KINDS.values() for leaf in leaves}
    print(f"| activations rounded to int8 | perplexity ({ids.shape[1]} tokens) |")
    print("|---|---|")
    print(f"| none (int8 weights only) | {perplexity(set()):.3f} |")
    print(f"| all | {perplexity(every):.3f} |")
    for kind, leaves in KINDS.items():
        print(f"| all but {kind} | {perplexity(every - set(leaves)):.3f} |")
    for kind, leaves in KINDS.items():
        print(f"| {kind} only | {perplexity(set(leaves)):.3f} |")
    print()
    print(
        "input row peak / mean magnitude: "
        + ", ".join(f"{k} {sum(v) / len(v):.1f}" for k, v in peaks.items())
    )


if __name__ == "__main__":
    main()
