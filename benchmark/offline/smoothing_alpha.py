"""W8A8's smoothing exponent: perplexity of the default model with every linear layer W8A8, by alpha (CPU).

    python benchmark/offline/smoothing_alpha.py [--alphas 0.3,0.4,0.5,0.6,0.8] [--threads 1]

transformers' float32 model of the embedded GGUF file (its Q4_1 values). The input peaks of each linear
layer come from one forward of minisgl's calibration text (`minisgl/models/smoothing.py`), or of a
fixed pseudo-random token sequence (the "random" rows); each layer is then multiplied as the engine's
W8A8 does: the weight's codes are those of w * s (int8, a scale a row), the input's of x / s (int8, a
scale a token), s = smoothing_factors(peak, w, alpha). The LM head is W8A8 too (the engine's choice).
Perplexity is over benchmark/data/plain_english.txt, a text the calibration never sees.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "..", "data", "plain_english.txt")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--alphas", default="0.3,0.4,0.5,0.6,0.8")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", ".."))
    from transformers import AutoModelForCausalLM

    from minisgl.layers.quant import quantize_rows, round_per_channel
    from minisgl.models.gguf import default_model_path
    from minisgl.models.smoothing import calibration_ids, smoothing_factors
    from minisgl.utils.hf import load_tokenizer, resolve_model_path

    torch.set_num_threads(args.threads)
    folder = resolve_model_path(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # the engine's head is a W8A8 copy of the tied embedding: untie, so the head can be replaced alone
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.clone())
    layers = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    floats = {n: m.weight.detach().clone() for n, m in layers.items()}
    vocab = model.config.vocab_size
    eval_ids = torch.tensor([list(load_tokenizer(folder).encode(open(TEXT).read()))])

    def peaks_of(ids: list[int]) -> dict[str, torch.Tensor]:
        found: dict[str, torch.Tensor] = {}

        def record(name: str):  # noqa: ANN202 - a forward pre-hook
            def hook(_: torch.nn.Module, a: tuple[torch.Tensor, ...]) -> None:
                peak = a[0].reshape(-1, a[0].shape[-1]).abs().amax(dim=0)
                found[name] = torch.maximum(found[name], peak) if name in found else peak

            return hook

        handles = [m.register_forward_pre_hook(record(n)) for n, m in layers.items()]
        with torch.inference_mode():
            model(torch.tensor([ids]))
        for h in handles:
            h.remove()
        return found

    def perplexity(peaks: dict[str, torch.Tensor] | None, alpha: float) -> float:
        handles = []
        for name, m in layers.items():
            w = floats[name]
            s = torch.ones(w.shape[1]) if peaks is None else smoothing_factors(peaks[name], w, alpha)
            codes, scale = round_per_channel(w * s)
            m.weight.data = codes * scale[:, None] / s  # the weight the unsmoothed input meets

            def hook(_: torch.nn.Module, a: tuple[torch.Tensor, ...], inv: torch.Tensor = 1 / s):  # noqa: ANN202
                x = a[0].reshape(-1, a[0].shape[-1])
                q, row = quantize_rows(x, inv)
                return ((q.float() * row / inv).reshape(a[0].shape), *a[1:])

            handles.append(m.register_forward_pre_hook(hook))
        with torch.inference_mode():
            loss = model(eval_ids, labels=eval_ids).loss.item()
        for h in handles:
            h.remove()
        for name, m in layers.items():
            m.weight.data = floats[name].clone()
        return math.exp(loss)

    with torch.inference_mode():
        base = math.exp(model(eval_ids, labels=eval_ids).loss.item())
    text_peaks = peaks_of(calibration_ids(folder, vocab, 4096))
    rng = random.Random(0)
    random_peaks = peaks_of([rng.randrange(vocab) for _ in range(256)])
    print(f"| calibration | alpha | perplexity ({eval_ids.shape[1]} tokens) |")
    print("|---|---|---|")
    print(f"| float32, nothing rounded | | {base:.3f} |")
    print(f"| none (W8A8 unsmoothed) | | {perplexity(None, 0):.3f} |")
    for alpha in (float(a) for a in args.alphas.split(",")):
        print(f"| calibration text | {alpha} | {perplexity(text_peaks, alpha):.3f} |", flush=True)
    print(f"| pseudo-random tokens | 0.5 | {perplexity(random_peaks, 0.5):.3f} |")


if __name__ == "__main__":
    main()
