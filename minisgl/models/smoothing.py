"""W8A8's smoothing (SmoothQuant): a factor per input channel of each layer, from the peaks of its inputs.

Rounding a token's activations to int8 with one scale a row costs most where a few channels carry values
tens of times larger than the rest (the inputs after the RMSNorms of SmolLM2-135M peak at 16-35x their
row's mean magnitude): every other channel keeps only a few levels. With s[k] = peak_x[k]^a /
peak_w[k]^(1 - a), the layer multiplies x[:, k] / s[k] by w[:, k] * s[k], the same product, with the
range split between the two operands; a = 0.5 is SmoothQuant's choice (0.4-0.6 measured within 0.2 of
perplexity of each other on the default model, the eval text's own noise; 0.3 and 0.8 worse).
The peaks come from one prefill of `CALIBRATION` through the float model at load
(`minisgl/engine/calibrate.py`): a few hundred tokens of mixed prose, chat, code and numbers. A
checkpoint without a tokenizer gets a fixed pseudo-random token sequence, which calibrates worse
(perplexity 25.93 against 25.45 for the text, docs/benchmarks.md, "Smoothed W8A8").
"""

from __future__ import annotations

import random

import torch

ALPHA = 0.5

# plain text of several kinds, so that the channels every kind of input lights up are seen
CALIBRATION = """\
The river starts as a thin stream high in the hills, where snow melts in late spring. By the time it
reaches the valley it is wide and slow, and the farmers on both banks draw water from it for their
fields of wheat, barley and beans. Every few years the river floods; the old town was built on a ridge
for that reason, and its stone bridge, finished in 1642, has survived eleven floods since.

Q: How many minutes are there in a week?
A: A day has 24 hours of 60 minutes, so 1,440 minutes; a week of 7 days has 7 x 1,440 = 10,080 minutes.

def mean(values: list[float]) -> float:
    if not values:
        raise ValueError("mean() of an empty list")
    return sum(values) / len(values)

print(mean([3.5, 4.0, 12.25]))  # 6.583333333333333

Dear team, the meeting moves to Thursday at 10:30 in room B-204. Please bring the draft budget, the
list of open questions from the customer, and your notes on the new schedule. Lunch is provided.

Ingredients: 2 eggs, 250 ml milk, 120 g flour, a pinch of salt, butter for the pan. Whisk, rest ten
minutes, then cook thin pancakes on a hot pan, about a minute a side.
"""

# a short conversation, rendered in the model's chat template where it has one
CHAT = [
    {"role": "user", "content": "What is the capital of Australia, and why is it not Sydney?"},
    {
        "role": "assistant",
        "content": "The capital is Canberra. It was chosen in 1908 as a compromise between Sydney and "
        "Melbourne, the two largest cities, which both wanted the title.",
    },
    {"role": "user", "content": "Translate 'thank you very much' into French, Spanish and German."},
]


def calibration_ids(model_dir: str, vocab_size: int, limit: int) -> list[int]:
    """The calibration text in the model's own tokens (at most `limit`); a checkpoint without a
    tokenizer gets a fixed pseudo-random sequence over its vocabulary instead."""
    try:
        from minisgl.utils.hf import chat_template_ids, load_tokenizer

        tokenizer = load_tokenizer(model_dir)
        ids = list(tokenizer.encode(CALIBRATION))
        if getattr(tokenizer, "chat_template", None):
            ids += chat_template_ids(tokenizer, CHAT)
    except (OSError, ValueError):
        rng = random.Random(0)
        ids = [rng.randrange(vocab_size) for _ in range(256)]
    return [i for i in ids if 0 <= i < vocab_size][:limit]


def smoothing_factors(input_peak: torch.Tensor, weight: torch.Tensor, alpha: float = ALPHA) -> torch.Tensor:
    """s [K] for a layer whose inputs peaked at input_peak [K] (|x| over the calibration tokens) and whose
    weight is [N, K]. Only the ratios between channels matter (a common factor cancels in the rounding);
    a channel the calibration never lit gets the factor of a small value, not a division by zero."""
    x_peak = input_peak.float().clamp(min=1e-5)
    w_peak = weight.float().abs().amax(dim=0).clamp(min=1e-5)
    return (x_peak.pow(alpha) / w_peak.pow(1 - alpha)).clamp(min=1e-5)
