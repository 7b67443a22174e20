"""A decode step's bf16 matmuls on the CPU: plain weights (F.linear) against oneDNN's blocked layout.

    python benchmark/offline/onednn_linear.py [--threads 1] [--rows 1,2,4,16,64,2048]

SmolLM2-135M's shapes: 30 layers' q|k|v, o, gate|up and down, each layer its own weights (a step
streams them all from memory, as in the engine), plus the LM head. For each number of rows: the time
of one such pass with plain weights (oneDNN copies each weight into its blocked layout inside the
call), with the weights packed once (`layers.linear.pack_onednn`), and at one and two rows with
minisgl's C kernel (`layers.linear.linear`'s few-row path). The best of --rounds passes, each format in
turn so that a change of load falls on all of them.
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

from minisgl.kernel import cpu as cpu_kernels  # noqa: E402
from minisgl.layers.linear import linear_onednn, onednn_packing_supported, pack_onednn  # noqa: E402

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD = (49152, 576)
LAYERS = 30


def best_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,2,4,16,64,2048")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if not onednn_packing_supported():
        raise SystemExit("this torch or CPU has no oneDNN bf16 matmul")
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).bfloat16() for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    weights.append(torch.randn(*HEAD, generator=gen).bfloat16())
    packed = [pack_onednn(w) for w in weights]
    lib = cpu_kernels.library()
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"threads {torch.get_num_threads()}; ms for 30 layers + LM head (GFLOP/s)")
    print("| rows | plain (F.linear) | oneDNN layout | C kernel | plain / oneDNN |")
    print("|---|---|---|---|---|")
    for m in [int(r) for r in args.rows.split(",")]:
        xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in {w.shape[1] for w in weights}}
        rounds = args.rounds if m < 1024 else 2
        plain = best_ms(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in weights], rounds)
        blocked = best_ms(
            lambda xs=xs: [linear_onednn(xs[w.shape[1]], p) for w, p in zip(weights, packed)], rounds
        )
        c_cell = "-"
        if lib is not None and m <= cpu_kernels.LINEAR_MAX_ROWS:
            c = best_ms(
                lambda xs=xs: [cpu_kernels.linear_bf16(lib, xs[w.shape[1]], w) for w in weights], rounds
            )
            c_cell = f"{c:.2f}"
        rate = flops_per_row * m / 1e6
        print(
            f"| {m} | {plain:.2f} ({rate / plain:.0f}) | {blocked:.2f} ({rate / blocked:.0f}) | {c_cell} "
            f"| {plain / blocked:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
