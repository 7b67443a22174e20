"""The matmuls of one decode step of SmolLM2-135M with its weights read from memory, as a real step reads them.

    python benchmark/offline/quant_step.py [--threads 1] [--rows 1,2,4,8]

quant_matmul.py times each layer shape again and again, so every weight but the LM head's sits in the
caches. Here 30 distinct layers of each shape (q|k|v, o, gate|up, down: 65 MB of int4) and the int8 LM
head (28 MB) are called in a step's order, so each weight comes from memory once a step. Formats: int4
layers + int8 head through minisgl's C kernel with int8 activation blocks (`qlinear.c`, the default on a
CPU with AVX512-VNNI) and through torch's weight-only kernels (`MINISGL_CPU_INT8_ACTIVATIONS=0`). Best
of 6 steps.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

# SmolLM2-135M's layer shapes [N, K] and its LM head
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
LAYERS = 30


def step_ms(q8: bool, rows: list[int]) -> list[float]:
    from minisgl.env import ENV
    from minisgl.layers.quant import Int4Weight, Int8Weight

    ENV.CPU_INT8_ACTIVATIONS.value = q8
    gen = torch.Generator().manual_seed(0)
    layers = [
        Int4Weight.from_float(torch.randn(n, k, generator=gen) * 0.02)
        for _ in range(LAYERS)
        for n, k in SHAPES
    ]
    layers.append(Int8Weight.from_float(torch.randn(*HEAD, generator=gen) * 0.02))
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in (576, 1536)}

        def step(xs: dict[int, torch.Tensor] = xs) -> None:
            for w in layers:
                w.matmul(xs[w.in_features])

        step()
        best = float("inf")
        for _ in range(6):
            start = time.perf_counter()
            step()
            best = min(best, time.perf_counter() - start)
        out.append(best * 1e3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,2,4,8")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    from minisgl.layers.quant import q8_kernels

    rows = [int(r) for r in args.rows.split(",")]
    formats = [("int8 activation blocks (C kernel)", True)] if q8_kernels() is not None else []
    formats.append(("bf16 activations (torch's kernels)", False))
    print(f"threads {args.threads}; ms per decode step, weights from memory")
    print("| format | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for label, q8 in formats:
        print(f"| {label} | " + " | ".join(f"{ms:.2f}" for ms in step_ms(q8, rows)) + " |", flush=True)


if __name__ == "__main__":
    main()
