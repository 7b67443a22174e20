"""silu(gate) * up in one pass over the gate|up projection's output.

With `prefetch` (a weight), programs beyond the kernel's own ask that weight into L2 for the down
projection that reads this output next (kernel/prefetch.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel.launch import direct_launch
from minisgl.kernel.prefetch import BLOCK as PREFETCH_BLOCK
from minisgl.kernel.prefetch import as_bytes, prefetch_part, prefetch_programs
from minisgl.utils.misc import div_ceil, next_pow2


@triton.jit
def _silu_and_mul_block(X, Y, t, col_block, n, stride_x, stride_y, BLOCK: tl.constexpr):
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(X + t * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + t * stride_x + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu rounded to the input dtype before the product, as the torch version does
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(Y + t * stride_y + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


@direct_launch
@triton.jit(do_not_specialize=["rows", "p_bytes"])
def _silu_and_mul_kernel(
    X,
    Y,
    n,
    stride_x,
    stride_y,
    rows,
    P,
    p_bytes,
    BLOCK: tl.constexpr,
    PREFETCH: tl.constexpr,
    P_BLOCK: tl.constexpr,
):
    # programs (t, c) for t < rows are the rows' column blocks; those past the rows prefetch
    t = tl.program_id(0)
    c = tl.program_id(1)
    if PREFETCH:
        if t >= rows:
            parts = (tl.num_programs(0) - rows) * tl.num_programs(1)
            prefetch_part(P, p_bytes, (t - rows) * tl.num_programs(1) + c, parts, P_BLOCK)
        else:
            _silu_and_mul_block(X, Y, t, c, n, stride_x, stride_y, BLOCK)
    else:
        _silu_and_mul_block(X, Y, t, c, n, stride_x, stride_y, BLOCK)


def silu_and_mul(x: torch.Tensor, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """x: [T, 2I] holding gate|up side by side -> [T, I]; `prefetch`: a CUDA weight to ask into L2."""
    x = x.contiguous()
    t, n = x.shape[0], x.shape[1] // 2
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    block = min(1024, next_pow2(n))
    blocks = div_ceil(n, block)
    extra, p_bytes, p = 0, 0, x
    if prefetch is not None:
        extra, p = div_ceil(prefetch_programs(x.device.index or 0), blocks), as_bytes(prefetch)
        p_bytes = p.numel()
    _silu_and_mul_kernel[(t + extra, blocks)](
        x,
        y,
        n,
        x.stride(0),
        y.stride(0),
        t,
        p,
        p_bytes,
        BLOCK=block,
        PREFETCH=extra > 0,
        P_BLOCK=PREFETCH_BLOCK,
        num_warps=4,
    )
    return y
