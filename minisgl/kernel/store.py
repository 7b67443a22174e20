"""Writing a step's K and V into the paged pool in one launch (torch's index_copy_ takes two)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K,
    V,
    KCache,
    VCache,
    Loc,
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
):
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < H) & (d < D)
    k = tl.load(K + t * stride_kt + heads * stride_kh + d, mask=mask)
    v = tl.load(V + t * stride_vt + heads * stride_vh + d, mask=mask)
    dst = slot * stride_ct + heads * stride_ch + d
    tl.store(KCache + dst, k, mask=mask)
    tl.store(VCache + dst, v, mask=mask)


def store_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor
) -> None:
    """k, v: [T, H, D] (strided views are fine); k_cache, v_cache: [slots, H, D]; loc: [T] token slots."""
    t, h, d = k.shape
    if t == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.stride() == v_cache.stride()
    _store_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        loc,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        H=h,
        BLOCK_H=triton.next_power_of_2(h),
        D=d,
        BLOCK_D=triton.next_power_of_2(d),
        num_warps=1 if h * d <= 512 else 4,
    )
