"""Decode attention with V stored transposed within pages: a variant for the FP8 cache, on one GPU.

    python benchmark/offline/decode_vt.py [--batches 64,256] [--json out.json]

On an FP8 pool the engine's decode kernel reads at about half of DRAM's rate (docs/benchmarks.md,
"Decode attention under Nsight Compute"): V is the second operand of the P x V product, which wants a
tile's keys side by side in each thread's registers, and in the pool ([slot, kv head, dim]) a key's
values are a row apart from the next key's; 8-bit elements have no transposing shared-memory load, so
Triton reads V one byte at a time. Here V is held as [page, kv head, dim, slot in page]: with pages of
P slots, P keys of one dim lie side by side, and a tile of BLOCK_N keys is BLOCK_N / P pages of
[dim, P]. K keeps the pool's layout (its dim, the product's inner axis, is already contiguous).

The variant is checked against the engine's kernel on the same data (every position of a request sits
at its page's offset pos % P, as the engine places it), then both are timed at the upstream workload's
contexts halfway, placed as the engine places them with pages of P. Without CUDA, `--check` runs the
comparison on small shapes under Triton's interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from minisgl.kernel import dot_precision  # noqa: E402
from minisgl.kernel.attention import _attend_tile  # noqa: E402


@triton.jit
def _decode_vt_kernel(
    Q,
    K,
    VT,
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
    stride_vp,
    stride_vh,
    qk_scale,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    P: tl.constexpr,
    FP8: tl.constexpr,
    PRECISION: tl.constexpr,
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
    if FP8:  # as the engine's kernel: e4m3 widens to fp16 exactly, and q joins it there
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
        qk_scale = qk_scale * tl.load(KScale)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    pt = PageTable + row * stride_pt
    pg = tl.arange(0, BLOCK_N // P)
    j = tl.arange(0, P)
    for n in range(0, seq_len, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        nmask = offs < seq_len
        slots = tl.load(pt + offs, mask=nmask, other=0).to(tl.int64)
        k = tl.load(
            K + slots[:, None] * stride_kt + kvh * stride_kh + d[None, :], mask=nmask[:, None], other=0.0
        )
        # the tile's pages: the slot of each page's first position, over P
        first = n + pg * P
        page = tl.load(pt + first, mask=first < seq_len, other=0).to(tl.int64) // P
        at = page[:, None, None] * stride_vp + kvh * stride_vh + d[None, :, None] * P + j[None, None, :]
        vmask = (first[:, None, None] + j[None, None, :]) < seq_len
        vt = tl.load(VT + at, mask=vmask, other=0.0)  # [pages, D, P]: P keys side by side
        v = tl.reshape(tl.permute(vt, (0, 2, 1)), (BLOCK_N, D))
        # the engine's online-softmax step (it widens FP8 tiles to q's dtype)
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, nmask, True, PRECISION)
    out = acc / l_i[:, None]
    if FP8:
        out = out * tl.load(VScale)
    tl.store(
        Out + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
        out.to(Out.dtype.element_ty),
        mask=hmask[:, None],
    )


def transpose_in_pages(v: torch.Tensor, page: int) -> torch.Tensor:
    """[slots, Hk, D] -> [pages, Hk, D, page]: each page's values of one dim side by side."""
    slots, hk, d = v.shape
    assert slots % page == 0
    return v.view(slots // page, page, hk, d).permute(0, 2, 3, 1).contiguous()


def decode_vt(
    q, k, vt, table, rows, seq, page: int, scales=None, block_n=128, warps=4, stages=2
) -> torch.Tensor:
    bs, hq, d = q.shape
    hk = k.shape[1]
    out = torch.empty_like(q)
    fp8 = k.dtype == torch.float8_e4m3fn
    ks, vs = scales if fp8 else (seq, seq)
    _decode_vt_kernel[(hk, bs)](
        q, k, vt, out, table, rows, seq, ks, vs,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), table.stride(0), out.stride(0), out.stride(1),
        vt.stride(0), vt.stride(1), d**-0.5 * 1.4426950408889634,
        GROUP=hq // hk, BLOCK_H=max(16, triton.next_power_of_2(hq // hk)), BLOCK_N=block_n, D=d, P=page,
        FP8=fp8, PRECISION=dot_precision(q.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out


def check(device: str) -> float:
    """The variant against the engine's kernel on a small paged batch; returns the largest relative error."""
    from decode_variants import engine_slots, page_table

    from minisgl.kernel import attention as attn

    page, hq, hk, d = 16, 4, 2, 16
    prompts, decoded = [5, 40, 17], [3, 30, 0]
    placement = engine_slots(prompts, decoded, page)
    lens = [len(s) for s in placement]
    size = -(-(max(max(s) for s in placement) + 1) // page) * page
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(size, hk, d, generator=gen).to(device)
    v = torch.randn(size, hk, d, generator=gen).to(device)
    q = torch.randn(len(lens), hq, d, generator=gen).to(device)
    table, i32 = page_table(placement, device), dict(dtype=torch.int32, device=device)
    rows, seq = torch.arange(len(lens), **i32), torch.tensor(lens, **i32)
    ref = attn.decode_attention(q, k, v, table, rows, seq, 1, d**-0.5)
    got = decode_vt(q, k, transpose_in_pages(v, page), table, rows, seq, page, block_n=32, stages=1)
    return ((got - ref).abs().max() / ref.abs().max()).item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="64,256")
    p.add_argument("--page", type=int, default=16)
    p.add_argument("--check", action="store_true", help="only the comparison on small shapes")
    p.add_argument("--json")
    args = p.parse_args()
    if args.check or not torch.cuda.is_available():
        print(
            f"largest relative difference against the engine's kernel: {check('cuda' if torch.cuda.is_available() else 'cpu'):.2e}"
        )
        return
    from decode_variants import engine_slots, page_table
    from roofline import bench_ms, workload

    from minisgl.kernel import attention as attn

    print(f"check: {check('cuda'):.2e}", flush=True)
    hq, hk, d, page = 16, 8, 128, args.page
    prompts_all, outs = workload()
    results: list[dict[str, Any]] = []
    for bs in (int(x) for x in args.batches.split(",")):
        prompts = [len(x) for x in prompts_all[:bs]]
        placement = engine_slots(prompts, [o // 2 for o in outs[:bs]], page)
        lens = [len(s) for s in placement]
        size = -(-(max(max(s) for s in placement) + 1) // page) * page
        table, i32 = page_table(placement, "cuda"), dict(dtype=torch.int32, device="cuda")
        rows, seq = torch.arange(bs, **i32), torch.tensor(lens, **i32)
        q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device="cuda")
        scales = (torch.ones(1, device="cuda") * 0.5, torch.ones(1, device="cuda") * 0.5)
        for fp8 in (False, True):
            k = torch.randn(size, hk, d, dtype=torch.bfloat16, device="cuda")
            v = torch.randn_like(k)
            if fp8:
                k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
            vt = transpose_in_pages(v, page)
            sc = scales if fp8 else None
            kv_bytes = 2 * sum(lens) * hk * d * k.element_size()
            engine = partial(attn.decode_attention, q, k, v, table, rows, seq, 1, d**-0.5, *(sc or ()))
            ref = engine()
            ms = bench_ms(engine)
            results.append(
                {"bs": bs, "fp8": fp8, "variant": "engine", "us": ms * 1e3, "tb_s": kv_bytes / ms / 1e9}
            )
            print(results[-1], flush=True)
            for bn in (64, 128):
                for st in (2, 3):
                    run = partial(decode_vt, q, k, vt, table, rows, seq, page, sc, bn, 4, st)
                    row: dict[str, Any] = {"bs": bs, "fp8": fp8, "variant": "vt", "block_n": bn, "stages": st}
                    try:
                        out = run()
                        row["rel_diff"] = (
                            (out.float() - ref.float()).abs().max() / ref.float().abs().max()
                        ).item()
                        ms = bench_ms(run)
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
