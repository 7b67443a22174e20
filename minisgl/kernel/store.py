"""Writing a step's K and V into the paged pool in one launch (torch's index_copy_ takes two).

An FP8 pool (float8_e4m3fn) stores clamp(x / scale, ±448) with the layer's K or V scale, as
`quantize_fp8` in minisgl/kvcache/mha_pool.py does on the torch path. `to_pool` is that conversion
for any kernel that writes the pool (the rotary kernel stores K/V with it too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel.launch import direct_launch
from minisgl.kvcache.mha_pool import FP8_DTYPE, FP8_MAX
from minisgl.utils.misc import next_pow2


@triton.jit
def _round_to_e4m3(x):
    """x (float32 within ±448) rounded to the nearest e4m3 value, ties to even: the cast after it is exact.

    The cast alone rounds so on a GPU, but Triton's CPU interpreter (where the tests run) does not where
    the rounding carries into the exponent (1.99 -> 1.0); rounding here makes both store the same bytes.
    """
    bits = x.to(tl.int32, bitcast=True)
    # normal e4m3 keeps 3 of float32's 23 mantissa bits: round the 20 dropped ones to nearest even
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).to(tl.float32, bitcast=True)
    # below 2^-6 e4m3 is subnormal, in steps of 2^-9; adding and taking away 1.5 * 2^23 rounds to an
    # integer, ties to even, on the magnitude; x's sign bit is put back as a bit, since Triton's `-sub`
    # is 0 - sub, which makes a negative value that rounds to 0 +0 where torch's cast gives -0
    a = tl.abs(x)
    sub = ((a * 512.0 + 12582912.0) - 12582912.0) / 512.0
    signed = (sub.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(a < 0.015625, signed, normal)


@triton.jit
def to_pool(x, Scale, Cache, FP8: tl.constexpr, FP8_LIMIT: tl.constexpr):
    """x as the pool `Cache` stores it: cast, and for FP8 first divided by the scale, clamped and rounded."""
    if FP8:
        # a multiply by the reciprocal could round differently from the torch path's division
        x = _round_to_e4m3(tl.clamp(x.to(tl.float32) / tl.load(Scale), -FP8_LIMIT, FP8_LIMIT))
    return x.to(Cache.dtype.element_ty)


def check_fp8_pool(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> bool:
    """Whether the pool is FP8; such a pool cannot be written or read without its scales."""
    fp8 = k_cache.dtype == FP8_DTYPE
    if fp8 and (k_scale is None or v_scale is None):
        raise ValueError("an FP8 pool needs the layer's k_scale and v_scale")
    return fp8


@direct_launch
@triton.jit
def _store_kv_kernel(
    K,
    V,
    KCache,
    VCache,
    Loc,
    KScale,
    VScale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ct,
    stride_ch,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FP8: tl.constexpr,
    FP8_LIMIT: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < H) & (d < D)
    k = tl.load(K + t * stride_kt + heads * stride_kh + d, mask=mask)
    v = tl.load(V + t * stride_vt + heads * stride_vh + d, mask=mask)
    dst = slot * stride_ct + heads * stride_ch + d
    tl.store(KCache + dst, to_pool(k, KScale, KCache, FP8, FP8_LIMIT), mask=mask)
    tl.store(VCache + dst, to_pool(v, VScale, VCache, FP8, FP8_LIMIT), mask=mask)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    loc: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """k, v: [T, H, D] (strided views are fine); k_cache, v_cache: [slots, H, D]; loc: [T] token slots.

    k_scale, v_scale: one-element float32 tensors, needed by (and only read for) an FP8 pool.
    """
    t, h, d = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    fp8 = check_fp8_pool(k_cache, k_scale, v_scale)
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        loc,
        k_scale if fp8 else loc,
        v_scale if fp8 else loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        H=h,
        BLOCK_H=next_pow2(h),
        D=d,
        BLOCK_D=next_pow2(d),
        FP8=fp8,
        FP8_LIMIT=FP8_MAX,
        num_warps=1 if h * d <= 512 else 4,
    )
