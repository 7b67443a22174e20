"""Decode attention with the next tile's rows asked for in registers (`DecodeConfig.prefetch`) against the
engine's tiles, on one GPU, bf16 and FP8 pools.

    python benchmark/offline/decode_prefetch.py [--batches 64,128,256] [--json out.json]

gather_rate.py: a bare gather of the FP8 pool's rows reads at 2.7 TB/s at 256 requests through the page
table and 3.25 at computed slots, and loads that feed tl.dot directly (bf16) at 4.2: Triton pipelines the
latter through shared memory, not rows widened from FP8 first. The prefetch variant pipelines by hand
(tile n's rows asked for during tile n - 1, their slots during n - 2). Each variant's output is compared with
the engine's, then timed on the workload's contexts halfway with the engine's allocation (kv_layout.py's
`engine` layout), splits and order, one CUDA-graph replay of ten launches a figure.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kv_layout import decode_case, graph_us, sweep_main  # noqa: E402

from minisgl.kernel import attention as attn  # noqa: E402

# (keys a tile, warps, stages, registers a thread or 0), each with prefetch on
VARIANTS = {
    True: [(128, 4, 1, 0), (128, 4, 2, 0), (128, 4, 1, 232), (64, 4, 1, 0), (64, 4, 2, 0), (64, 4, 1, 168),
           (128, 8, 1, 0), (256, 8, 1, 0)],
    False: [(64, 4, 1, 0), (64, 4, 2, 0), (128, 4, 1, 0), (128, 8, 1, 0), (64, 8, 1, 0)],
}  # fmt: skip


def run_batch(bs: int, fp8: bool, hk: int = 8, d: int = 128) -> list[dict[str, Any]]:
    c = decode_case(bs, "engine", fp8)
    order = c.order()
    splits = attn.decode_splits(bs, hk)

    def decode() -> torch.Tensor:
        return attn.decode_attention(
            c.q, c.k, c.v, c.table, c.rows, c.seq, splits, d**-0.5, *c.scales, None, order
        )

    attn.DECODE_CONFIG = None
    ref = decode()
    results = [dict(bs=bs, fp8=fp8, variant="engine", us=graph_us(decode), max_diff=0.0)]
    for block_n, warps, stages, regs in VARIANTS[fp8]:
        name = f"prefetch {block_n},{warps},{stages},{regs}"
        attn.DECODE_CONFIG = attn.DecodeConfig(block_n, warps, stages, True, regs or None, prefetch=True)
        try:
            diff = (decode().float() - ref.float()).abs().max().item()
            us = graph_us(decode)
        except Exception as e:  # a configuration the compiler or the SM's shared memory refuses
            print(f"bs={bs} fp8={int(fp8)} {name}: {type(e).__name__}: {str(e)[:100]}", flush=True)
            continue
        results.append(dict(bs=bs, fp8=fp8, variant=name, us=us, max_diff=diff))
    attn.DECODE_CONFIG = None
    for r in results:
        r["tb_s"] = c.kv_bytes / r["us"] / 1e6
        print(
            f"bs={bs} {'fp8 ' if fp8 else 'bf16'} {r['variant']:>24}: {r['us']:7.1f} us ({r['tb_s']:.2f} TB/s), "
            f"max diff against the engine {r['max_diff']:.2e}",
            flush=True,
        )
    return results


if __name__ == "__main__":
    sweep_main(__doc__, run_batch, "64,128,256")
