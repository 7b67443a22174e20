"""Decode attention's read rate against where the pool's slots lie and how the pool orders its axes.

    python benchmark/offline/kv_layout.py [--batches 64,256] [--json out.json]

The decode kernel gathers one row of D elements a key and KV head through the page table: 128 bytes on an
FP8 pool, 256 on bf16. How those rows lie in DRAM depends on the allocator and the pool's layout:

- `random`: every slot anywhere (a permutation; what the other decode benchmarks time);
- `engine`: page size 1 on a fresh pool, as the workload runs: each prompt one run of slots, then each
  decode step one slot a request, the batch's slots side by side, so a request's generated tokens lie a
  batch apart;
- `page16`: the same with pages of 16 slots: a request's generated tokens fill its page before the next;
- `contiguous`: each request's whole context one run (the best an allocator could do).

Each is timed with the pool token-major ([slots, KV heads, D], the engine's: a token's heads side by side)
and head-major ([KV heads, slots, D] seen through a transpose: a head's tokens side by side, so a run of
slots is one stream of bytes for the program that reads it). The decode kernel takes the strides as they
are, so both layouts run the engine's kernel unchanged. Beside it, a bare gather (the kernel's K and V loads
summed, nothing multiplied) gives the read rate of the pattern alone. Every figure is a CUDA-graph replay
of the workload's contexts halfway (roofline.py's mid_run_contexts) at the engine's tiles, splits and order.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from minisgl.env import ENV  # noqa: E402
from minisgl.kernel import attention as attn  # noqa: E402

LAUNCHES = 10
LAYOUTS = ("random", "engine", "page16", "contiguous")


def graph_us(fn: Any) -> float:
    """Device time of one fn(), from replays of a graph of LAUNCHES calls."""
    from skinny_gemm import graph_ms

    return graph_ms(lambda: [fn() for _ in range(LAUNCHES)]) * 1e3 / LAUNCHES


def slot_table(layout: str, prompts: list[int], gens: list[int], page: int) -> tuple[list[list[int]], int]:
    """Each request's slots (prompt then generated tokens) under `layout`, and the slots the pool needs."""
    bs = len(prompts)
    if layout == "contiguous":
        out, at = [], 0
        for p, g in zip(prompts, gens):
            out.append(list(range(at, at + p + g)))
            at += p + g
        return out, at
    if layout == "random":
        total = sum(prompts) + sum(gens)
        perm = torch.randperm(total + 64).tolist()
        out, at = [], 0
        for p, g in zip(prompts, gens):
            out.append(perm[at : at + p + g])
            at += p + g
        return out, total + 64
    # the allocator on a fresh pool: pages handed out in order, a prompt's pages at once, then one
    # slot a request each step, a new page when its last is full
    size = 1 if layout == "engine" else page
    out = [[] for _ in range(bs)]
    next_page = 0
    for i, p in enumerate(prompts):
        n = -(-p // size)
        out[i] = [(next_page + j // size) * size + j % size for j in range(p)]
        next_page += n
    for step in range(max(gens)):
        for i in range(bs):
            if step >= gens[i]:
                continue
            used = len(out[i])
            if used % size == 0:  # the request's last page is full: a new one
                out[i].append(next_page * size)
                next_page += 1
            else:
                out[i].append(out[i][-1] + 1)
    return out, next_page * size


@triton.jit
def _gather_kernel(K, V, Out, PageTable, SeqLens, stride_kt, stride_kh, stride_pt, BLOCK_N: tl.constexpr,
                   D: tl.constexpr):  # fmt: skip
    # the decode kernel's loads alone: full tiles of BLOCK_N keys, K and V at one tile of offsets, summed
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    seq_len = tl.load(SeqLens + b)
    d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for n in range(0, seq_len // BLOCK_N * BLOCK_N, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        slots = tl.load(PageTable + b * stride_pt + offs).to(tl.int64)
        at = slots[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        acc += tl.sum(tl.load(K + at).to(tl.float32) + tl.load(V + at).to(tl.float32), 0)
    tl.store(Out + (b * tl.num_programs(0) + kvh) * D + d, acc)


@dataclass
class DecodeCase:
    """A decode batch of the workload halfway: its contexts, page table, pool and query, on the GPU."""

    lens: list[int]
    table: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scales: tuple[torch.Tensor | None, torch.Tensor | None]
    q: torch.Tensor
    rows: torch.Tensor
    seq: torch.Tensor

    @property
    def kv_bytes(self) -> int:
        return 2 * sum(self.lens) * self.k.shape[1] * self.k.shape[2] * self.k.element_size()

    def order(self) -> torch.Tensor | None:
        """The engine's program order for this batch: longest first from MINISGL_DECODE_LONGEST_FIRST rows."""
        if not attn.ordered_from(len(self.lens), int(ENV.DECODE_LONGEST_FIRST.value)):
            return None
        return torch.tensor(attn.decode_order(self.lens), dtype=torch.int32, device="cuda")


def decode_case(
    bs: int, layout: str, fp8: bool, head_major: bool = False, hq: int = 16, hk: int = 8, d: int = 128
) -> DecodeCase:
    """The first `bs` requests of the workload halfway through their outputs, their slots under `layout`."""
    from roofline import workload

    prompts_ids, outs = workload()
    prompts = [len(p) for p in prompts_ids[:bs]]
    gens = [o // 2 for o in outs[:bs]]
    lens = [p + g for p, g in zip(prompts, gens)]
    slots, n_slots = slot_table(layout, prompts, gens, 16)
    n_slots = max(n_slots, sum(lens) + 128)  # room for a gather at computed slots (each context one run)
    table = torch.zeros(bs, max(lens) + 128, dtype=torch.int32)
    for i, s in enumerate(slots):
        table[i, : len(s)] = torch.tensor(s, dtype=torch.int32)
    dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
    shape = (hk, n_slots, d) if head_major else (n_slots, hk, d)
    k = torch.randn(shape, device="cuda").to(dtype)
    v = torch.randn(shape, device="cuda").to(dtype)
    if head_major:
        k, v = k.transpose(0, 1), v.transpose(0, 1)  # [slots, KV heads, D] seen over head-major bytes
    return DecodeCase(
        lens=lens,
        table=table.cuda(),
        k=k,
        v=v,
        scales=(torch.ones(1, device="cuda"), torch.ones(1, device="cuda")) if fp8 else (None, None),
        q=torch.randn(bs, hq, d, dtype=torch.bfloat16, device="cuda"),
        rows=torch.arange(bs, dtype=torch.int32, device="cuda"),
        seq=torch.tensor(lens, dtype=torch.int32, device="cuda"),
    )


def run_case(bs: int, layout: str, head_major: bool, fp8: bool, hk: int = 8, d: int = 128) -> dict:
    c = decode_case(bs, layout, fp8, head_major)
    k, v, table, seq = c.k, c.v, c.table, c.seq
    order = c.order()
    splits = attn.decode_splits(bs, hk)
    kv_bytes = c.kv_bytes

    def decode() -> torch.Tensor:
        return attn.decode_attention(c.q, k, v, table, c.rows, seq, splits, d**-0.5, *c.scales, None, order)

    out = torch.empty(bs, hk, d, dtype=torch.float32, device="cuda")

    def gather() -> None:
        _gather_kernel[(hk, bs)](
            k, v, out, table, seq, k.stride(0), k.stride(1), table.stride(0), BLOCK_N=128, D=d, num_warps=4,
            num_stages=4,
        )  # fmt: skip

    us_decode, us_gather = graph_us(decode), graph_us(gather)
    return dict(
        bs=bs, layout=layout, head_major=head_major, fp8=fp8, kv_bytes=kv_bytes, us_decode=us_decode,
        tb_s_decode=kv_bytes / us_decode / 1e6, us_gather=us_gather, tb_s_gather=kv_bytes / us_gather / 1e6,
    )  # fmt: skip


def sweep_main(doc: str, run_batch: Callable[[int, bool], list[dict[str, Any]]], batches: str) -> None:
    """The command line of a sweep over batch sizes and both pools: `--batches`, `--json`."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--batches", default=batches)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = []
    for bs in [int(b) for b in args.batches.split(",")]:
        for fp8 in (True, False):
            results += run_batch(bs, fp8)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", default="64,256")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    results = []
    for bs in [int(b) for b in args.batches.split(",")]:
        for fp8 in (False, True):
            for head_major in (False, True):
                for layout in LAYOUTS:
                    r = run_case(bs, layout, head_major, fp8)
                    results.append(r)
                    print(
                        f"bs={bs} {'fp8 ' if fp8 else 'bf16'} {'head-major ' if head_major else 'token-major'} "
                        f"{layout:>10}: decode {r['us_decode']:7.1f} us ({r['tb_s_decode']:.2f} TB/s), "
                        f"gather {r['us_gather']:7.1f} us ({r['tb_s_gather']:.2f} TB/s)",
                        flush=True,
                    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
