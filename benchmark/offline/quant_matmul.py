"""The matmuls of one decode step of SmolLM2-135M in each weight format, at a few batch sizes (CPU).

    python benchmark/offline/quant_matmul.py [--threads 1] [--rows 1,4,8,16,64]

For each number of rows M: the time of the 30 layers' q|k|v, o, gate|up and down projections plus the
LM head (the whole weight a step reads), with bf16 activations against bf16 weights (minisgl's
`linear`: the C kernel for 1-2 rows, oneDNN above), float32 against float32, and the packed int8 and
int4 weights (torch's `_weight_int8pack_mm` / `_weight_int4pack_mm_for_cpu`). Best of 5 repeats.
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


def layer_us(x: torch.Tensor, w: torch.Tensor, packed: tuple[object, object]) -> dict[str, float]:
    from minisgl.layers.linear import linear

    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    i8, i4 = packed
    return {
        "float32": best_us(lambda: F.linear(x, w)),
        "bf16": best_us(lambda: linear(xb, wb)),
        "int8": best_us(lambda: i8.matmul(xb)),  # type: ignore[attr-defined]
        "int4": best_us(lambda: i4.matmul(xb)),  # type: ignore[attr-defined]
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--rows", default="1,4,8,16,64")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from minisgl.layers.quant import Int4Weight, Int8Weight

    gen = torch.Generator().manual_seed(0)
    weights = {name: torch.randn(n, k, generator=gen) * 0.02 for name, (n, k) in SHAPES.items()}
    packed = {name: (Int8Weight.from_float(w), Int4Weight.from_float(w)) for name, w in weights.items()}
    print(f"threads {torch.get_num_threads()}; ms per decode step (30 layers + LM head)")
    print("| rows | float32 | bf16 | int8 | int4 | per layer (us, bf16 / int8 / int4) |")
    print("|---|---|---|---|---|---|")
    for m in [int(r) for r in args.rows.split(",")]:
        total = {"float32": 0.0, "bf16": 0.0, "int8": 0.0, "int4": 0.0}
        detail = []
        for name, w in weights.items():
            us = layer_us(torch.randn(m, w.shape[1], generator=gen), w, packed[name])
            times = 1 if name == "lm_head" else LAYERS
            for key, value in us.items():
                total[key] += value * times / 1000
            detail.append(f"{name} {us['bf16']:.0f}/{us['int8']:.0f}/{us['int4']:.0f}")
        cells = " | ".join(f"{total[k]:.2f}" for k in ("float32", "bf16", "int8", "int4"))
        print(f"| {m} | {cells} | {', '.join(detail)} |", flush=True)


if __name__ == "__main__":
    main()
