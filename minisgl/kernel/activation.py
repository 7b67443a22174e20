"""silu(gate) * up in one pass over the gate|up projection's output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel.launch import direct_launch
from minisgl.utils.misc import div_ceil, next_pow2


@direct_launch
@triton.jit
def _silu_and_mul_kernel(X, Y, n, stride_x, stride_y, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(X + t * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + t * stride_x + n + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # silu rounded to the input dtype before the product, as the torch version does
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(Y + t * stride_y + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2I] holding gate|up side by side -> [T, I]."""
    x = x.contiguous()
    t, n = x.shape[0], x.shape[1] // 2
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    block = min(1024, next_pow2(n))
    _silu_and_mul_kernel[(t, div_ceil(n, block))](x, y, n, x.stride(0), y.stride(0), BLOCK=block, num_warps=4)
    return y
