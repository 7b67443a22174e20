"""Decode attention with several KV heads a program ("packed"), against the engine's kernel.

    python benchmark/offline/decode_packed.py [--json out.json] [--batches 64,128,256]
    TRITON_INTERPRET=1 python benchmark/offline/decode_packed.py --check   # on a CPU: outputs only

The engine's decode kernel runs one program per (request, KV head, split): its query tile is 16 rows of
which GROUP (2 on Qwen3-0.6B) are heads, so 14 of 16 rows of every score, exp and rescale are padding,
and each program gathers 128-byte rows (FP8) at one address each. Here a program takes HEADS KV heads of
a token at once: the query tile is block-diagonal, row r holding head r's query in the columns of its own
KV head and zeros elsewhere, so one [16, HEADS * D] x [HEADS * D, BLOCK_N] dot gives every row the
scores against its own head's keys (the zeros drop the others), and the P x V dot gives each row its
head's output in its own columns, picked out once at the end. The tensor-core work a token is what the
engine's kernel does (16 rows either way); the softmax work falls by the padding, and each key row read
is HEADS x D contiguous elements (1 KB of FP8 at HEADS = 8) instead of D.
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

_LOG2E = 1.4426950408889634

# one tile of keys into the online softmax, as the engine's kernel takes it (the same signature serves)
from minisgl.kernel.attention import _attend_tile  # noqa: E402


@triton.jit
def _packed_kernel(
    Q,
    K,
    V,
    Out,
    MidO,
    MidLse,
    PageTable,
    Rows,
    SeqLens,
    KScale,
    VScale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_pt,
    stride_ot,
    stride_oh,
    num_splits,
    qk_scale,
    NUM_QO_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    SPLIT: tl.constexpr,
    FP8: tl.constexpr,
    HALF: tl.constexpr,
    PRECISION: tl.constexpr,
):
    g = tl.program_id(0)
    b = tl.program_id(1)
    s = tl.program_id(2)
    row = tl.load(Rows + b).to(tl.int64)
    seq_len = tl.load(SeqLens + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = s * chunk
    end = tl.minimum(start + chunk, seq_len)

    r = tl.arange(0, 16)  # query rows: this program's HEADS * GROUP heads, padded to the dot's 16
    c = tl.arange(0, HEADS * D)  # columns: the HEADS KV heads' dims side by side, as the pool holds them
    rmask = r < HEADS * GROUP
    own = (r // GROUP)[:, None] == (c // D)[None, :]  # the block diagonal: a row's own KV head
    heads = g * HEADS * GROUP + r
    q = tl.load(
        Q + b * stride_qt + heads[:, None] * stride_qh + (c % D)[None, :],
        mask=rmask[:, None] & own,
        other=0.0,
    )
    if HALF:  # as the engine's kernel: e4m3 widens to fp16 exactly, and a bf16 query joins it there
        q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)
    if FP8:
        qk_scale = qk_scale * tl.load(KScale)
    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, HEADS * D], tl.float32)
    cols = g * HEADS * D + c  # the KV heads are contiguous in a pool row (stride_kh == D)
    tail = start + tl.maximum(end - start, 0) // BLOCK_N * BLOCK_N
    for n in range(start, tail, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        slots = tl.load(PageTable + row * stride_pt + offs).to(tl.int64)
        at = slots[:, None] * stride_kt + cols[None, :]
        m_i, l_i, acc = _attend_tile(
            q, tl.load(K + at), tl.load(V + at), m_i, l_i, acc, qk_scale, offs, False, PRECISION
        )
    for n in range(tail, end, BLOCK_N):
        offs = n + tl.arange(0, BLOCK_N)
        nmask = offs < end
        slots = tl.load(PageTable + row * stride_pt + offs, mask=nmask, other=0).to(tl.int64)
        at = slots[:, None] * stride_kt + cols[None, :]
        k = tl.load(K + at, mask=nmask[:, None], other=0.0)
        v = tl.load(V + at, mask=nmask[:, None], other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, m_i, l_i, acc, qk_scale, nmask, True, PRECISION)
    # each row's output is in its own KV head's columns: the others hold other heads' values, dropped
    picked = tl.sum(tl.reshape(tl.where(own, acc, 0.0), (16, HEADS, D)), 1)
    d = tl.arange(0, D)
    if SPLIT:
        out = picked / tl.maximum(l_i, 1e-30)[:, None]
        if FP8:
            out = out * tl.load(VScale)
        base = (b * NUM_QO_HEADS + heads) * num_splits + s
        tl.store(MidO + base[:, None] * D + d[None, :], out, mask=rmask[:, None])
        tl.store(MidLse + base, m_i + tl.log2(l_i), mask=rmask)
    else:
        out = picked / l_i[:, None]
        if FP8:
            out = out * tl.load(VScale)
        ptr = Out + b * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(ptr, out.to(Out.dtype.element_ty), mask=rmask[:, None])


def packed_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    table: torch.Tensor,
    rows: torch.Tensor,
    seq: torch.Tensor,
    splits: int,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
    heads: int,
    block_n: int,
    warps: int,
    stages: int,
) -> torch.Tensor:
    """The packed kernel (and the engine's merge kernel for splits); same arguments as decode_attention."""
    from minisgl.kernel import attention as attn
    from minisgl.kernel import dot_precision

    bs, hq, d = q.shape
    hk = k.shape[1]
    group = hq // hk
    assert k.stride(1) == d and hk % heads == 0 and heads * group <= 16 and k.stride() == v.stride()
    fp8 = k.dtype == torch.float8_e4m3fn
    out = torch.empty_like(q)
    if splits > 1:
        mid_o = torch.empty((bs, hq, splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((bs, hq, splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out
    ks, vs = scales if fp8 and scales else (seq, seq)
    _packed_kernel[(hk // heads, bs, splits)](
        q, k, v, out, mid_o, mid_lse, table, rows, seq, ks, vs,
        q.stride(0), q.stride(1), k.stride(0), table.stride(0), out.stride(0), out.stride(1),
        splits, d**-0.5 * _LOG2E,
        NUM_QO_HEADS=hq, GROUP=group, HEADS=heads, BLOCK_N=block_n, D=d, SPLIT=splits > 1, FP8=fp8,
        HALF=fp8 and q.dtype != torch.float32, PRECISION=dot_precision(q.dtype), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        attn._decode_merge_kernel[(bs, hq)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), splits,
            NUM_QO_HEADS=hq, D=d, BLOCK_D=d, BLOCK_S=triton.next_power_of_2(splits), num_warps=4,
        )  # fmt: skip
    return out


def reference(q, k, v, table, rows, seq, scales) -> torch.Tensor:
    """Attention of each request's query over its context in float32, by torch."""
    hq, hk = q.shape[1], k.shape[1]
    fp8 = k.dtype == torch.float8_e4m3fn
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for i in range(q.shape[0]):
        idx = table[rows[i], : seq[i]].long()
        kk, vv = k[idx].float(), v[idx].float()
        if fp8:
            kk, vv = kk * scales[0], vv * scales[1]
        kk = kk.repeat_interleave(hq // hk, 1)
        vv = vv.repeat_interleave(hq // hk, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].float(), kk) * q.shape[-1] ** -0.5, -1)
        out[i] = torch.einsum("hn,nhd->hd", p, vv)
    return out


def check(device: str) -> None:
    """The packed kernel against torch on small batches: every HEADS, splits, ragged tails, FP8."""
    torch.manual_seed(0)
    for hq, hk, heads in ((4, 2, 1), (4, 2, 2), (16, 8, 8), (16, 8, 4), (8, 2, 2)):
        for fp8 in (False, True):
            for splits in (1, 3):
                d, lens = 16, [5, 37, 64, 1]
                slots = sum(lens) + 8
                k = torch.randn(slots, hk, d, device=device)
                v = torch.randn_like(k)
                scales = (torch.full((1,), 0.5, device=device), torch.full((1,), 0.25, device=device))
                if fp8:
                    k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
                perm = torch.randperm(slots, device=device)[: sum(lens)].to(torch.int32)
                table = torch.zeros(len(lens), max(lens), dtype=torch.int32, device=device)
                at = 0
                for i, n in enumerate(lens):
                    table[i, :n] = perm[at : at + n]
                    at += n
                rows = torch.arange(len(lens), dtype=torch.int32, device=device)
                seq = torch.tensor(lens, dtype=torch.int32, device=device)
                q = torch.randn(len(lens), hq, d, device=device)
                got = packed_decode(q, k, v, table, rows, seq, splits, scales, heads, 16, 4, 2)
                want = reference(q, k, v, table, rows, seq, scales)
                err = (got.float() - want).abs().max().item()
                assert err < 1e-3, (hq, hk, heads, fp8, splits, err)
                print(f"ok hq={hq} hk={hk} heads={heads} fp8={fp8} splits={splits} max diff {err:.2e}")


def bench(batches: list[int], hq: int) -> list[dict[str, Any]]:
    from decode_variants import clocks_up, kv_pools, scattered_batch
    from skinny_gemm import graph_ms

    def graph_us(fn: Any) -> float:
        return graph_ms(fn) * 1e3

    from minisgl.kernel import attention as attn

    hk, d = 8, 128
    clocks_up()
    results: list[dict[str, Any]] = []
    for bs in batches:
        lens, table, rows, seq = scattered_batch(bs)
        total = sum(lens)
        q = torch.randn(bs, hq, d, dtype=torch.bfloat16, device="cuda")
        for fp8 in (False, True):
            k, v, scales = kv_pools(total + 64, hk, d, fp8)
            kv_bytes = 2 * total * hk * d * k.element_size()
            sc = scales if fp8 else (None, None)
            splits = attn.decode_splits(bs, hk)
            engine = partial(attn.decode_attention, q, k, v, table, rows, seq, splits, d**-0.5, *sc)
            ref = engine()
            us = graph_us(engine)
            base = {"bs": bs, "hq": hq, "fp8": fp8, "variant": "engine", "splits": splits, "us": us,
                    "tb_s": kv_bytes / us / 1e6}  # fmt: skip
            results.append(base)
            print(base, flush=True)
            for heads in (h for h in (2, 4, 8) if h * hq // hk <= 16):
                want = triton.cdiv(attn.TARGET_PROGRAMS, bs * hk // heads)
                for sp in sorted({1, max(1, min(attn.MAX_SPLITS, want))}):
                    # a key tile of HEADS x D columns: fewer keys a tile as it widens (registers)
                    for bn in (16, 32) if heads == 8 else (32, 64):
                        for warps in (4, 8):
                            for stages in (2, 3):
                                row: dict[str, Any] = {"bs": bs, "hq": hq, "fp8": fp8, "variant": "packed", "heads": heads,
                                                       "splits": sp, "block_n": bn, "warps": warps,
                                                       "stages": stages}  # fmt: skip
                                fn = partial(packed_decode, q, k, v, table, rows, seq, sp, scales if fp8 else None,
                                             heads, bn, warps, stages)  # fmt: skip
                                try:
                                    out = fn()
                                    row["rel_diff"] = (out.float() - ref.float()).abs().max().item() / max(
                                        ref.float().abs().max().item(), 1e-12
                                    )
                                    us = graph_us(fn)
                                    row |= {
                                        "us": us,
                                        "tb_s": kv_bytes / us / 1e6,
                                        "vs_engine": base["us"] / us,
                                    }
                                except Exception as e:  # a configuration the compiler refuses is a row
                                    row["error"] = str(e)[:200]
                                results.append(row)
                                print(row, flush=True)
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json")
    p.add_argument("--batches", default="64,128,256")
    p.add_argument(
        "--q-heads", type=int, default=16, help="query heads over 8 KV heads of 128 (32: Llama-3-8B)"
    )
    p.add_argument("--check", action="store_true", help="outputs against torch only (any device)")
    args = p.parse_args()
    if args.check:
        check("cuda" if torch.cuda.is_available() else "cpu")
        return
    results = bench([int(b) for b in args.batches.split(",")], args.q_heads)
    best: dict[tuple[int, bool], dict[str, Any]] = {}
    for r in results:
        if r["variant"] == "packed" and "us" in r and r["rel_diff"] < 2e-2:
            key = (r["bs"], r["fp8"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    for (bs, fp8), r in sorted(best.items()):
        print(f"best packed bs={bs} fp8={fp8}: {r}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "best": [v for _, v in sorted(best.items())]}, f, indent=1)


if __name__ == "__main__":
    main()
