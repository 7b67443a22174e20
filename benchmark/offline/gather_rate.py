"""How fast a program gathers a decode step's K/V rows, by row width: the bound under the FP8 decode kernel.

    python benchmark/offline/gather_rate.py [--batches 128,256] [--json out.json]

kv_layout.py found the FP8 decode kernel as fast as a bare gather of its rows (about 3 TB/s at 256 requests,
bf16's gather 3.9) whatever the slots' layout. What a gathered row costs beyond its bytes is what this
times: programs that read HEADS adjacent KV heads of each key (a row of HEADS x 128 elements: 128 bytes a
head on FP8), through the page table or at computed slots, summed on the CUDA cores or through tl.dot (so
that the loads take the dot's pipeline), over the workload's contexts halfway with the engine's allocation
(kv_layout.py's `engine` layout), one CUDA-graph replay of ten launches a figure.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kv_layout import decode_case, graph_us, sweep_main  # noqa: E402

# (KV heads a program, keys a tile, warps, stages, through the page table, through tl.dot)
CONFIGS = [
    (1, 128, 4, 4, True, False), (1, 128, 4, 2, True, False), (1, 128, 8, 4, True, False),
    (1, 256, 4, 3, True, False), (1, 256, 8, 3, True, False), (1, 64, 4, 6, True, False),
    (1, 128, 4, 4, True, True), (1, 128, 4, 4, False, False),
    (2, 128, 4, 3, True, False), (2, 128, 8, 3, True, False), (2, 64, 4, 4, True, False),
    (2, 128, 4, 3, True, True), (2, 64, 4, 4, True, True), (2, 128, 4, 3, False, False),
    (4, 64, 4, 3, True, False), (4, 64, 8, 3, True, False), (8, 32, 4, 3, True, False), (8, 32, 8, 3, True, False),
]  # fmt: skip


@triton.jit
def _gather_kernel(K, V, Out, PageTable, Starts, SeqLens, stride_kt, stride_pt, HEADS: tl.constexpr,
                   BLOCK_N: tl.constexpr, D: tl.constexpr, TABLE: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
    # HEADS adjacent KV heads of every key as one row of HEADS * D elements (the pool is token-major, so
    # they are contiguous), full tiles only
    g = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    c = tl.arange(0, HEADS * D)
    if DOT:
        acc2 = tl.zeros([16, HEADS * D], tl.float32)
    else:
        acc = tl.zeros([HEADS * D], tl.float32)
    for n in range(0, seq_len // BLOCK_N * BLOCK_N, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        if TABLE:
            slots = tl.load(PageTable + b * stride_pt + offs).to(tl.int64)
        else:
            slots = tl.load(Starts + b).to(tl.int64) + offs
        at = slots[:, None] * stride_kt + g * HEADS * D + c[None, :]
        k = tl.load(K + at)
        v = tl.load(V + at)
        if DOT:
            ones = tl.full([16, BLOCK_N], 1.0, tl.float16)
            acc2 += tl.dot(ones, k.to(tl.float16)) + tl.dot(ones, v.to(tl.float16))
        else:
            acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    if DOT:
        acc = tl.sum(acc2, 0)
    tl.store(Out + (b * tl.num_programs(0) + g) * HEADS * D + c, acc)


def run_batch(bs: int, fp8: bool, hk: int = 8, d: int = 128) -> list[dict[str, Any]]:
    c = decode_case(bs, "engine", fp8)
    k, v, table, seq, lens = c.k, c.v, c.table, c.seq, c.lens
    # each context's first slot, were it one run: the gather at computed slots
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0)[:-1].tolist()], dtype=torch.int32, device="cuda")
    results = []
    for heads, block_n, warps, stages, through_table, dot in CONFIGS:
        if not fp8 and heads > 2:
            continue
        out = torch.empty(bs, hk * d, dtype=torch.float32, device="cuda")
        read = sum(n // block_n * block_n for n in lens) * 2 * hk * d * k.element_size()

        def gather(h: int = heads, bn: int = block_n, w: int = warps, s: int = stages, t: bool = through_table,
                   dt: bool = dot, o: torch.Tensor = out) -> None:  # fmt: skip
            _gather_kernel[(hk // h, bs)](
                k, v, o, table, starts, seq, k.stride(0), table.stride(0), HEADS=h, BLOCK_N=bn, D=d, TABLE=t,
                DOT=dt, num_warps=w, num_stages=s,
            )  # fmt: skip

        try:
            us = graph_us(gather)
        except Exception as e:  # a configuration the compiler or the SM's shared memory refuses
            print(
                f"bs={bs} fp8={int(fp8)} {heads},{block_n},{warps},{stages}: {type(e).__name__}", flush=True
            )
            continue
        row = dict(bs=bs, fp8=fp8, heads=heads, block_n=block_n, warps=warps, stages=stages,
                   table=through_table, dot=dot, us=us, tb_s=read / us / 1e6)  # fmt: skip
        results.append(row)
        print(
            f"bs={bs} {'fp8 ' if fp8 else 'bf16'} heads={heads} keys={block_n:3d} warps={warps} stages={stages} "
            f"table={int(through_table)} dot={int(dot)}: {us:7.1f} us, {row['tb_s']:.2f} TB/s",
            flush=True,
        )
    return results


if __name__ == "__main__":
    sweep_main(__doc__, run_batch, "128,256")
