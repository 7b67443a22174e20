"""The matmuls of one decode step of SmolLM2-135M in each weight format, at a few batch sizes (CPU).

    python benchmark/offline/quant_matmul.py [--threads 1] [--rows 1,4,8,16,64]

For each number of rows M: the time of the 30 layers' q|k|v, o, gate|up and down projections plus the
LM head (the whole weight a step reads), with bf16 activations against bf16 weights (minisgl's
`linear`: the C kernel for 1-2 rows, oneDNN above), float32 against float32, the packed int8 and
int4 weights (torch's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`), and w8a8: the int8 weights
times the activations quantized to int8 per row (`torch._int_mm`, the quantize and rescale included),
with the LM head once as int8 weight-only (the engine's choice) and once as W8A8. Best of 5 repeats.
On a CPU with AVX512-VNNI also int8 and int4 as the engine runs them there: minisgl's C kernel with the
activations rounded to int8 in blocks of 32 (`minisgl/kernel/cpu/qlinear.c`, "q8" columns).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads of 64 (3 KV heads), vocabulary 49152, 30 layers
SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
LAYERS = 30


def best_us(fn: Callable[[], object], iters: int = 20) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e6


FORMATS = ("float32", "bf16", "int8", "int4", "w8a8", "int8 q8", "int4 q8")


def layer_us(x: torch.Tensor, w: torch.Tensor, packed: tuple[object, ...]) -> dict[str, float]:
    from minisgl.layers.linear import linear

    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    i8, i4, w8a8, i8q, i4q = packed
    # the formats interleaved a layer at a time, so a change of load moves them alike
    return {
        "float32": best_us(lambda: F.linear(x, w)),
        "bf16": best_us(lambda: linear(xb, wb)),
        "int8": best_us(lambda: i8.matmul(xb)),  # type: ignore[attr-defined]
        "int4": best_us(lambda: i4.matmul(xb)),  # type: ignore[attr-defined]
        "w8a8": best_us(lambda: w8a8.matmul(xb)),  # type: ignore[attr-defined]
        "int8 q8": best_us(lambda: i8q.matmul(xb)) if i8q is not None else float("nan"),  # type: ignore[attr-defined]
        "int4 q8": best_us(lambda: i4q.matmul(xb)) if i4q is not None else float("nan"),  # type: ignore[attr-defined]
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rows", default="1,4,8,16,64")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from minisgl.env import ENV
    from minisgl.layers.quant import Int4Weight, Int8Weight, W8A8Weight, q8_kernels

    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(n, k, generator=gen) * 0.02 for name, (n, k) in SHAPES.items()}
    fast = q8_kernels() is not None
    packed = {}
    for name, w in weights.items():
        q8 = (Int8Weight.from_float(w), Int4Weight.from_float(w)) if fast else (None, None)
        ENV.CPU_INT8_ACTIVATIONS.value = False  # torch's weight-only kernels
        packed[name] = (Int8Weight.from_float(w), Int4Weight.from_float(w), W8A8Weight.from_float(w), *q8)
        ENV.CPU_INT8_ACTIVATIONS.value = True
    print(f"threads {torch.get_num_threads()}; ms per decode step (30 layers + LM head)")
    print(
        "| rows | float32 | bf16 | int8 | int4 | w8a8 (int8 head) | w8a8 (W8A8 head) | int8 q8 | int4 q8 (int8 q8 head) "
        "| per layer (us, bf16 / int8 / int4 / w8a8 / int4 q8) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in [int(r) for r in args.rows.split(",")]:
        total = dict.fromkeys(FORMATS, 0.0)
        head: dict[str, float] = {}
        detail = []
        for name, w in weights.items():
            us = layer_us(torch.randn(m, w.shape[1], generator=gen), w, packed[name])
            times = 1 if name == "lm_head" else LAYERS
            for key, value in us.items():
                total[key] += value * times / 1000
            if name == "lm_head":
                head = us
            detail.append(
                "/".join(f"{us[k]:.0f}" for k in ("bf16", "int8", "int4", "w8a8", "int4 q8")) + f" {name}"
            )
        int8_head = total["w8a8"] + (head["int8"] - head["w8a8"]) / 1000
        # the engine packs the LM head as int8 beside int4 layers
        int4_q8 = total["int4 q8"] + (head["int8 q8"] - head["int4 q8"]) / 1000
        cells = " | ".join(f"{total[k]:.2f}" for k in FORMATS[:4])
        print(
            f"| {m} | {cells} | {int8_head:.2f} | {total['w8a8']:.2f} | {total['int8 q8']:.2f} | {int4_q8:.2f} "
            f"| {', '.join(detail)} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
