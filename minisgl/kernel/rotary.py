"""Rotary embedding of q and k in place, one launch for both (the rotate-half layout of HF checkpoints).

Qwen3's RMSNorm over each q and k head can be folded in: the head is in registers already. So can the
write of this step's K (rotated) and V into the paged pool, which otherwise takes a launch of its own
(store.py) that reads K back: the conversion to the pool's dtype is store.py's `to_pool`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from minisgl.kernel import ROWS_WHOLE
from minisgl.kernel.launch import direct_launch, wait_for_inputs
from minisgl.kernel.norm import row_inv_rms
from minisgl.kernel.store import check_fp8_pool, to_pool
from minisgl.kvcache.mha_pool import FP8_MAX
from minisgl.utils.misc import next_pow2

if TYPE_CHECKING:
    from minisgl.attention.base import KVDestination


@triton.jit
def _rotate(
    X,
    W,
    eps,
    t,
    stride_t,
    stride_h,
    cos,
    sin,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    S,
    stride_s,
    s_eps,
    SCALE: tl.constexpr,
    S_N: tl.constexpr,
    S_BLOCK: tl.constexpr,
    scale,
):
    """Rotates token t's heads in place and returns the two rotated halves, [BLOCK_H, HALF] each. With SCALE
    the heads are first multiplied by row t of S's 1 / rms (rounded to their dtype, as the projection's
    output was): SCALE 1 reduces the row here, SCALE 2 takes it as `scale`."""
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = heads[:, None] < H
    ptr = X + t * stride_t + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
    if SCALE:
        if SCALE == 1:  # after the heads' loads are issued, so that both reads are in flight together
            scale = row_inv_rms(S, t, stride_s, s_eps, S_N, S_BLOCK)
        x1 = (x1.to(tl.float32) * scale).to(x1.dtype)
        x2 = (x2.to(tl.float32) * scale).to(x2.dtype)
    if NORM:
        # rounded where the torch version rounds: the normalised head, then the product with the weight
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = tl.rsqrt((tl.sum(f1 * f1, 1) + tl.sum(f2 * f2, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + d).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + d).to(tl.float32)[None, :]
        x1 = ((f1 * inv).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype)
        x2 = ((f2 * inv).to(x2.dtype).to(tl.float32) * w2).to(x2.dtype)
    # cos/sin are rounded to the input dtype first, as the torch version (and transformers) do
    c = cos.to(x1.dtype).to(tl.float32)[None, :]
    s = sin.to(x1.dtype).to(tl.float32)[None, :]
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    y1 = (a * c - b * s).to(x1.dtype)
    y2 = (b * c + a * s).to(x1.dtype)
    tl.store(ptr, y1, mask=mask)
    tl.store(ptr + HALF, y2, mask=mask)
    return y1, y2


@direct_launch
@triton.jit
def _rope_kernel(
    Q,
    K,
    V,
    Pos,
    CosSin,
    QW,
    KW,
    KCache,
    VCache,
    Loc,
    KScale,
    VScale,
    S,
    eps,
    s_eps,
    stride_s,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    stride_cs,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
    STORE: tl.constexpr,
    FP8: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALE: tl.constexpr,
    S_N: tl.constexpr,
    S_BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    # SPLIT: three programs a token (q, k with its store, v's store) whose loads are in flight at once;
    # otherwise one program does the three in turn, each waiting on its own loads
    part = tl.program_id(1) if SPLIT else -1
    pos = tl.load(Pos + t)
    d = tl.arange(0, HALF)
    # the table row is [cos | sin], each D wide with its two halves equal
    cos = tl.load(CosSin + pos * stride_cs + d)
    sin = tl.load(CosSin + pos * stride_cs + 2 * HALF + d)
    heads = tl.arange(0, BLOCK_HK)[:, None]
    mask = heads < HK
    # SCALE: q|k|v came from the hidden states S unnormalised (the norm's weight folded into the projection):
    # each of the three programs multiplies by S's 1 / rms, read after its own loads are issued; one program
    # a token (prefill's many tokens) reduces the row once, for the three parts
    scale = 1.0
    part_scale: tl.constexpr = 0 if not SCALE else (1 if SPLIT else 2)
    if part_scale == 2:
        scale = row_inv_rms(S, t, stride_s, s_eps, S_N, S_BLOCK)
    if part <= 0:
        _rotate(
            Q, QW, eps, t, stride_qt, stride_qh, cos, sin, HQ, BLOCK_HQ, HALF, NORM, S, stride_s, s_eps,
            part_scale, S_N, S_BLOCK, scale,
        )  # fmt: skip
    if part < 0 or part == 1:
        k1, k2 = _rotate(
            K, KW, eps, t, stride_kt, stride_kh, cos, sin, HK, BLOCK_HK, HALF, NORM, S, stride_s, s_eps,
            part_scale, S_N, S_BLOCK, scale,
        )  # fmt: skip
        if STORE:
            dst = tl.load(Loc + t).to(tl.int64) * stride_ct + heads * stride_ch + d[None, :]
            tl.store(KCache + dst, to_pool(k1, KScale, KCache, FP8, FP8_LIMIT), mask=mask)
            tl.store(KCache + dst + HALF, to_pool(k2, KScale, KCache, FP8, FP8_LIMIT), mask=mask)
    if STORE and (part < 0 or part == 2):
        dst = tl.load(Loc + t).to(tl.int64) * stride_ct + heads * stride_ch + d[None, :]
        src = V + t * stride_vt + heads * stride_vh + d[None, :]
        v1 = tl.load(src, mask=mask)
        v2 = tl.load(src + HALF, mask=mask)
        if SCALE:
            if part_scale == 1:  # after v's loads are issued
                scale = row_inv_rms(S, t, stride_s, s_eps, S_N, S_BLOCK)
            v1 = (v1.to(tl.float32) * scale).to(v1.dtype)
            v2 = (v2.to(tl.float32) * scale).to(v2.dtype)
            # and in place, as q and k are: a step of fresh prompts attends over these rows, not the pool's
            tl.store(src, v1, mask=mask)
            tl.store(src + HALF, v2, mask=mask)
        tl.store(VCache + dst, to_pool(v1, VScale, VCache, FP8, FP8_LIMIT), mask=mask)
        tl.store(VCache + dst + HALF, to_pool(v2, VScale, VCache, FP8, FP8_LIMIT), mask=mask)


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    v: torch.Tensor | None = None,
    dest: KVDestination | None = None,
    split: bool | None = None,
    row_scale: tuple[torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D] (strided views are fine, the last dim contiguous), rotated in place.

    With qk_norm = (q weight, k weight, eps), each head is RMS-normalised first, in the same pass.
    With dest (and v, [T, Hk, D]), the rotated K and V are also written into the pool at dest.loc, as
    store.store_kv writes them. split=False runs one program a token instead of three (q, k, v), the same
    bits (with a row scale, up to the last bit of its reduction, which the two compiled layouts may round
    apart); by default (None) three up to ROWS_WHOLE tokens (a decode batch: the parts' loads in flight side
    by side), one from there (a prefill: enough programs anyway, and a row scale reduced once a token).
    With row_scale = (hidden states [T, N], eps), q, k and v are first multiplied by each row's 1 / rms(hidden):
    the norm before the projection, its weight folded into the projection (models/llama.py's `fold_norms`);
    v is scaled by the program that stores it (in place too), so row_scale needs dest.
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and d % 2 == 0
    if dest is not None and v is None:
        raise ValueError("storing K/V from the rotary kernel needs v beside the destination")
    if row_scale is not None and dest is None:
        raise ValueError("a row scale needs the K/V destination: v is scaled where it is stored")
    if t == 0:
        return q, k
    if split is None:
        split = t < ROWS_WHOLE
    fp8 = False
    if dest is not None:
        assert v is not None and v.shape == k.shape and v.stride(-1) == 1
        assert dest.k_cache.stride() == dest.v_cache.stride() and dest.k_cache.stride(-1) == 1
        fp8 = check_fp8_pool(dest.k_cache, dest.k_scale, dest.v_scale)
    # unused pointer arguments get a tensor that is there: a kernel variant without STORE never reads them
    _rope_kernel[(t, (3 if dest else 2) if split else 1)](
        q,
        k,
        v if dest else k,
        positions,
        cos_sin,
        qk_norm[0] if qk_norm else q,
        qk_norm[1] if qk_norm else k,
        dest.k_cache if dest else k,
        dest.v_cache if dest else k,
        dest.loc if dest else positions,
        dest.k_scale if dest else cos_sin,
        dest.v_scale if dest else cos_sin,
        row_scale[0] if row_scale else q,
        qk_norm[2] if qk_norm else 0.0,
        row_scale[1] if row_scale else 0.0,
        row_scale[0].stride(0) if row_scale else 0,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0) if dest else 0,
        v.stride(1) if dest else 0,
        dest.k_cache.stride(0) if dest else 0,
        dest.k_cache.stride(1) if dest else 0,
        cos_sin.stride(0),
        HQ=hq,
        HK=hk,
        BLOCK_HQ=next_pow2(hq),
        BLOCK_HK=next_pow2(hk),
        HALF=d // 2,
        NORM=qk_norm is not None,
        STORE=dest is not None,
        FP8=fp8,
        FP8_LIMIT=FP8_MAX,
        SPLIT=split,
        SCALE=row_scale is not None,
        S_N=row_scale[0].shape[-1] if row_scale else 1,
        S_BLOCK=next_pow2(row_scale[0].shape[-1]) if row_scale else 1,
        num_warps=4,
    )
    return q, k
