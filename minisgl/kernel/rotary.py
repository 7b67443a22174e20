"""Rotary embedding of q and k in place, one launch for both (the rotate-half layout of HF checkpoints).

Qwen3's RMSNorm over each q and k head can be folded in: the head is in registers already.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
):
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, HALF)
    mask = heads[:, None] < H
    ptr = X + t * stride_t + heads[:, None] * stride_h + d[None, :]
    x1 = tl.load(ptr, mask=mask, other=0.0)
    x2 = tl.load(ptr + HALF, mask=mask, other=0.0)
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
    tl.store(ptr, (a * c - b * s).to(x1.dtype), mask=mask)
    tl.store(ptr + HALF, (b * c + a * s).to(x1.dtype), mask=mask)


@triton.jit
def _rope_kernel(
    Q,
    K,
    Pos,
    CosSin,
    QW,
    KW,
    eps,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HALF: tl.constexpr,
    NORM: tl.constexpr,
):
    t = tl.program_id(0)
    pos = tl.load(Pos + t)
    d = tl.arange(0, HALF)
    # the table row is [cos | sin], each D wide with its two halves equal
    cos = tl.load(CosSin + pos * stride_cs + d)
    sin = tl.load(CosSin + pos * stride_cs + 2 * HALF + d)
    _rotate(Q, QW, eps, t, stride_qt, stride_qh, cos, sin, HQ, BLOCK_HQ, HALF, NORM)
    _rotate(K, KW, eps, t, stride_kt, stride_kh, cos, sin, HK, BLOCK_HK, HALF, NORM)


def apply_rotary(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D] (strided views are fine, the last dim contiguous), rotated in place.

    With qk_norm = (q weight, k weight, eps), each head is RMS-normalised first, in the same pass.
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and d % 2 == 0
    if t == 0:
        return q, k
    _rope_kernel[(t,)](
        q,
        k,
        positions,
        cos_sin,
        qk_norm[0] if qk_norm else q,
        qk_norm[1] if qk_norm else k,
        qk_norm[2] if qk_norm else 0.0,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin.stride(0),
        HQ=hq,
        HK=hk,
        BLOCK_HQ=triton.next_power_of_2(hq),
        BLOCK_HK=triton.next_power_of_2(hk),
        HALF=d // 2,
        NORM=qk_norm is not None,
        num_warps=4,
    )
    return q, k
