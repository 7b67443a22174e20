"""Decode attention kernel variants against the engine's, on one GPU: the same pool data, bf16 and FP8.

    python benchmark/offline/decode_variants.py [--json out.json]

The engine's kernel (minisgl/kernel/attention.py) takes as long on an FP8 pool as on a bf16 one (half the
bytes), so something other than DRAM bytes bounds it. The variants here test which:
  tc      the engine's kernel (tensor-core dots on a [16, BLOCK_N] tile of which GROUP rows are heads);
  tc_even the same with the full tiles loaded without masks and only the last tile masked (the engine's
          kernel with DecodeConfig.even, which it now takes for FP8 pools and small 16-bit batches);
  fp8_qk  (FP8 pools) the scores' dot in FP8 on the tensor cores: q rounded to e4m3 with a scale a head,
          so K is used as stored and only V is widened (to fp16) for the output's dot;
  tiles   (--only tiles) the engine's kernel over a grid of tile configurations: keys a tile, warps,
          stages, unmasked full tiles or not; with the engine's split count for the batch (decode_splits).
  layout  (--only layout) the engine's choice and its alternatives on three placements of the same
          contexts: slots scattered at random; as the engine places them with pages of one slot (each
          prompt in one run, then every decode step's tokens side by side across the batch); and with
          pages of 16 slots (a request's decode tokens in runs of 16).
  cc      no tensor cores: the GROUP heads' scores and outputs as float32 products and sums, so a tile
          goes from memory to registers and is used there (no shared-memory round trip, no padding rows).
Each variant's output is checked against the engine kernel's before it is timed. Decode contexts are the
upstream workload's halfway through (roofline.py's mid_run_contexts), slots scattered as pages are.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from typing import Any

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@triton.jit
def _cc_kernel(
    Q,
    K,
    V,
    Out,
    PageTable,
    Rows,
    SeqLens,
    KScale,
    VScale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_pt,
    stride_ot,
    stride_oh,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
):
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    row = tl.load(Rows + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b)
    h = tl.arange(0, BLOCK_H)
    hmask = h < GROUP
    heads = kvh * GROUP + h
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    if FP8:
        qk_scale = qk_scale * tl.load(KScale)
    q = q.to(tl.float32) * qk_scale
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for n in range(0, seq_len, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        nmask = offs < seq_len
        slots = tl.load(PageTable + row * stride_pt + offs, mask=nmask, other=0).to(tl.int64)
        at = slots[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        k = tl.load(K + at, mask=nmask[:, None], other=0.0).to(tl.float32)
        qk = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + at, mask=nmask[:, None], other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    out = acc / l_i[:, None]
    if FP8:
        out = out * tl.load(VScale)
    tl.store(
        Out + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=hmask[:, None],
    )


@triton.jit
def _fp8_qk_kernel(
    Q,
    K,
    V,
    Out,
    PageTable,
    Rows,
    SeqLens,
    KScale,
    VScale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_pt,
    stride_ot,
    stride_oh,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
):
    """the unmasked tiles with the scores' dot in FP8: q rounded to e4m3 with a scale a head, K used as stored."""
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    row = tl.load(Rows + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b)
    h = tl.arange(0, BLOCK_H)
    hmask = h < GROUP
    heads = kvh * GROUP + h
    d = tl.arange(0, D)
    q = tl.load(Q + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=hmask[:, None], other=0.0)
    q = q.to(tl.float32)
    q_scale = tl.maximum(tl.max(tl.abs(q), 1), 1e-20) / 448.0
    q8 = (q / q_scale[:, None]).to(tl.float8e4nv)
    row_scale = q_scale * qk_scale * tl.load(KScale)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for n in range(0, seq_len, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        nmask = offs < seq_len
        slots = tl.load(PageTable + row * stride_pt + offs, mask=nmask, other=0).to(tl.int64)
        at = slots[:, None] * stride_kt + kvh * stride_kh + d[None, :]
        k = tl.load(K + at, mask=nmask[:, None], other=0.0)
        v = tl.load(V + at, mask=nmask[:, None], other=0.0).to(tl.float16)
        qk = tl.dot(q8, tl.trans(k)) * row_scale[:, None]
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v)
        m_i = m_new
    out = acc / l_i[:, None] * tl.load(VScale)
    tl.store(
        Out + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=hmask[:, None],
    )


def run_variant(kernel: Any, block_h: int, q, k, v, table, rows, seq, scales, block_n, warps, stages) -> Any:
    """One launch of a variant; kernel None: the engine's kernel with unmasked full tiles of this shape."""
    if kernel is None:
        from minisgl.kernel import attention as attn

        attn.DECODE_CONFIG = attn.DecodeConfig(block_n, warps, stages, even=True)
        try:
            fp8 = k.dtype == torch.float8_e4m3fn
            return attn.decode_attention(
                q, k, v, table, rows, seq, 1, q.shape[-1] ** -0.5, *(scales if fp8 else ())
            )
        finally:
            attn.DECODE_CONFIG = None
    bs, hq, d = q.shape
    hk = k.shape[1]
    out = torch.empty_like(q)
    fp8 = k.dtype == torch.float8_e4m3fn
    ks, vs = scales if fp8 else (seq, seq)
    kernel[(hk, bs)](
        q, k, v, out, table, rows, seq, ks, vs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), table.stride(0), out.stride(0), out.stride(1),
        d**-0.5 * 1.4426950408889634,
        GROUP=hq // hk, BLOCK_H=block_h, BLOCK_N=block_n, D=d, FP8=fp8, num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def sweep_tiles(bs: int, q, k, v, table, rows, seq, scales, kv_bytes: float) -> list[dict[str, Any]]:
    """The engine's kernel at every tile configuration of the grid, each checked against the chosen one."""
    from roofline import bench_ms

    from minisgl.kernel import attention as attn

    fp8 = k.dtype == torch.float8_e4m3fn
    splits = attn.decode_splits(bs, k.shape[1])
    args = (q, k, v, table, rows, seq, splits, q.shape[-1] ** -0.5, *(scales if fp8 else ()))
    chosen = attn.decode_config(bs, k.shape[1], q.dtype, fp8)
    ref = attn.decode_attention(*args)
    rows_out: list[dict[str, Any]] = []
    # registers bound the kernel's occupancy (at 128 keys and 4 warps: 177 a thread on an FP8 pool, two
    # programs an SM; 136 on bf16, three), so the grid spans keys a tile and warps, which set them
    grid = [
        attn.DecodeConfig(bn, w, st, even)
        for bn in (32, 64, 128)
        for w in (4, 8)
        for st in (2, 3)
        for even in (False, True)
    ]
    for cfg in grid:
        attn.DECODE_CONFIG = cfg
        row: dict[str, Any] = {"bs": bs, "fp8": fp8, "splits": splits, "variant": "tiles",
                               "block_n": cfg.block_n, "warps": cfg.num_warps, "stages": cfg.num_stages,
                               "even": cfg.even, "chosen": cfg == chosen}  # fmt: skip
        try:
            out = attn.decode_attention(*args)
            row["max_diff"] = (out.float() - ref.float()).abs().max().item()
            row["rel_diff"] = row["max_diff"] / max(ref.float().abs().max().item(), 1e-12)
            ms = bench_ms(partial(attn.decode_attention, *args))
            row |= {"us": ms * 1e3, "tb_s": kv_bytes / ms / 1e9}
        except Exception as e:  # a configuration the compiler refuses is a row, not the end
            row["error"] = str(e)[:200]
        finally:
            attn.DECODE_CONFIG = None
        rows_out.append(row)
        print(row, flush=True)
    return rows_out


def clocks_up() -> None:
    """A second of matmuls: the first kernels of a process otherwise meet the GPU's idle clocks."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    for _ in range(60):
        a @ a
    torch.cuda.synchronize()


def kv_pools(
    slots: int, hk: int, d: int, fp8: bool
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """Random K and V pools of `slots` rows (FP8: the bf16 values cast) and the layer's two scales (0.5)."""
    k = torch.randn(slots, hk, d, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    scales = (torch.ones(1, device="cuda") * 0.5, torch.ones(1, device="cuda") * 0.5)
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
    return k, v, scales


def scattered_batch(bs: int) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The workload's contexts halfway for `bs` requests, on slots scattered over a pool 64 slots larger:
    the context lengths, the page table, the rows and the sequence lengths as the kernel takes them."""
    from roofline import mid_run_contexts

    lens = mid_run_contexts(bs)
    total = sum(lens)
    slots = torch.randperm(total + 64, device="cuda")[:total].to(torch.int32)
    table = torch.zeros(bs, max(lens), dtype=torch.int32, device="cuda")
    start = 0
    for i, n in enumerate(lens):
        table[i, :n] = slots[start : start + n]
        start += n
    rows = torch.arange(bs, dtype=torch.int32, device="cuda")
    return lens, table, rows, torch.tensor(lens, dtype=torch.int32, device="cuda")


def engine_slots(prompts: list[int], decoded: list[int], page: int) -> list[list[int]]:
    """Each request's slots as the engine allocates them, lowest free page first: every prompt's pages at
    admission, then one token a step for each request still decoding (a new page when its last is full)."""
    nxt = 0
    slots: list[list[int]] = []
    for n in prompts:
        pages = -(-n // page)
        slots.append([nxt + i for i in range(n)])
        nxt += pages * page
    for step in range(max(decoded)):
        for r, d in enumerate(decoded):
            if step >= d:
                continue
            pos = len(slots[r])
            if pos % page == 0:  # the request's last page is full
                slots[r].append(nxt)
                nxt += page
            else:
                slots[r].append(slots[r][-1] + 1)
    return slots


def page_table(placement: list[list[int]], device: str) -> torch.Tensor:
    """The page table of each request's slots, one row a request."""
    table = torch.zeros(len(placement), max(len(s) for s in placement), dtype=torch.int32, device=device)
    for i, sl in enumerate(placement):
        table[i, : len(sl)] = torch.tensor(sl, dtype=torch.int32, device=device)
    return table


def compare_layouts(bs: int) -> list[dict[str, Any]]:
    """The decode kernel on one batch of contexts under three slot placements, bf16 and FP8 pools."""
    from roofline import bench_ms, workload

    from minisgl.kernel import attention as attn

    hq, hk, d = 16, 8, 128
    prompts_all, outs = workload()
    prompts = [len(p) for p in prompts_all[:bs]]
    decoded = [o // 2 for o in outs[:bs]]
    lens = [p + o for p, o in zip(prompts, decoded)]
    total = sum(lens)
    placements = {
        "engine-page1": engine_slots(prompts, decoded, 1),
        "engine-page16": engine_slots(prompts, decoded, 16),
    }
    size = max(max(max(x) for x in v) for v in placements.values()) + 1
    flat = torch.randperm(size)[:total].tolist()  # the same contexts on slots scattered over the pool
    starts = [sum(lens[:i]) for i in range(bs)]
    placements = {"scattered": [flat[a : a + n] for a, n in zip(starts, lens)]} | placements
    rows = torch.arange(bs, dtype=torch.int32, device="cuda")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device="cuda")
    splits = attn.decode_splits(bs, hk)
    out_rows: list[dict[str, Any]] = []
    for fp8 in (False, True):
        k = torch.randn(size, hk, d, dtype=torch.bfloat16, device="cuda")
        v = torch.randn_like(k)
        scales = (torch.ones(1, device="cuda") * 0.5, torch.ones(1, device="cuda") * 0.5)
        if fp8:
            k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        kv_bytes = 2 * total * hk * d * k.element_size()
        chosen = attn.decode_config(bs, hk, q.dtype, fp8)
        configs = [
            ("chosen", chosen),
            ("wide-4", attn.DecodeConfig(128, 4, 4)),
            ("even-64-3", attn.DecodeConfig(64, 4, 3, True)),
        ]
        for name, placement in placements.items():
            table = page_table(placement, "cuda")
            args = (q, k, v, table, rows, seq, splits, d**-0.5, *(scales if fp8 else ()))
            ref = attn.decode_attention(*args)
            for label, cfg in configs:
                attn.DECODE_CONFIG = cfg
                try:
                    out = attn.decode_attention(*args)
                    rel = (out.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
                    ms = bench_ms(partial(attn.decode_attention, *args))
                finally:
                    attn.DECODE_CONFIG = None
                row = {"bs": bs, "fp8": fp8, "placement": name, "config": label,
                       "us": ms * 1e3, "tb_s": kv_bytes / ms / 1e9, "rel_diff": rel}  # fmt: skip
                out_rows.append(row)
                print(row, flush=True)
    return out_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--batches", default="64,256")
    p.add_argument(
        "--only",
        choices=["all", "fp8_qk", "even", "tiles", "layout"],
        default="all",
        help="one variant beside the engine's",
    )
    args = p.parse_args()
    from roofline import bench_ms

    from minisgl.kernel import attention as attn

    hq, hk, d = 16, 8, 128
    clocks_up()
    results: list[dict[str, Any]] = []
    if args.only == "layout":
        for bs in (int(b) for b in args.batches.split(",")):
            results += compare_layouts(bs)
    for bs in (int(b) for b in args.batches.split(",")) if args.only != "layout" else ():
        lens, table, rows, seq = scattered_batch(bs)
        total = sum(lens)
        q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device="cuda")
        for fp8 in (False, True):
            k, v, scales = kv_pools(total + 64, hk, d, fp8)
            kv_bytes = 2 * total * hk * d * k.element_size()
            args_fp8 = scales if fp8 else (None, None)
            ref = attn.decode_attention(q, k, v, table, rows, seq, 1, d**-0.5, *args_fp8)
            ms = bench_ms(partial(attn.decode_attention, q, k, v, table, rows, seq, 1, d**-0.5, *args_fp8))
            base = {"bs": bs, "fp8": fp8, "variant": "tc", "us": ms * 1e3, "tb_s": kv_bytes / ms / 1e9}
            results.append(base)
            print(base, flush=True)
            if args.only == "tiles":
                results += sweep_tiles(bs, q, k, v, table, rows, seq, scales, kv_bytes)
                continue
            if args.only == "even":
                grid = [("tc_even", None, 16, 128, 4, s) for s in (3, 4)]
            elif args.only == "fp8_qk":
                grid = [("tc_even", None, 16, 128, 4, s) for s in (3, 4)]
                if fp8:
                    grid += [("fp8_qk", _fp8_qk_kernel, bh, bn, w, s) for bh in (16, 64) for bn in (64, 128, 256)
                             for w in (4, 8) for s in (3, 4)]  # fmt: skip
            else:
                grid = [
                    ("cc", _cc_kernel, 2, bn, w, s) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3)
                ]
                grid += [("tc_even", None, 16, bn, 4, s) for bn in (64, 128) for s in (2, 3, 4)]
            for name, kernel, bh, bn, w, s in grid:
                row: dict[str, Any] = {
                    "bs": bs,
                    "fp8": fp8,
                    "variant": name,
                    "block_n": bn,
                    "warps": w,
                    "stages": s,
                }
                try:
                    out = run_variant(kernel, bh, q, k, v, table, rows, seq, scales, bn, w, s)
                    row["max_diff"] = (out.float() - ref.float()).abs().max().item()
                    ms = bench_ms(
                        partial(run_variant, kernel, bh, q, k, v, table, rows, seq, scales, bn, w, s)
                    )
                    row |= {"us": ms * 1e3, "tb_s": kv_bytes / ms / 1e9}
                except Exception as e:  # a configuration the compiler refuses is a row, not the end
                    row["error"] = str(e)[:200]
                results.append(row)
                print(row, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
