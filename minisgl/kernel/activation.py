"""silu(gate) * up in one pass over the gate|up projection's output."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel import ROWS_WHOLE
from minisgl.kernel.launch import direct_launch, wait_for_inputs
from minisgl.kernel.norm import row_inv_rms
from minisgl.utils.misc import div_ceil, next_pow2


@direct_launch
@triton.jit
def _silu_and_mul_kernel(
    X,
    Y,
    S,
    n,
    stride_x,
    stride_y,
    stride_s,
    eps,
    BLOCK: tl.constexpr,
    SCALE: tl.constexpr,
    S_N: tl.constexpr,
    S_BLOCK: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    wait_for_inputs(PDL)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(X + t * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(X + t * stride_x + n + cols, mask=mask, other=0.0)
    if SCALE:
        # gate|up came from the hidden states S unnormalised (the norm's weight folded into the projection)
        scale = row_inv_rms(S, t, stride_s, eps, S_N, S_BLOCK)
        gate = (gate.to(tl.float32) * scale).to(gate.dtype)
        up = (up.to(tl.float32) * scale).to(up.dtype)
    g = gate.to(tl.float32)
    # silu rounded to the input dtype before the product, as the torch version does
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(Y + t * stride_y + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(x: torch.Tensor, row_scale: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """x: [T, 2I] holding gate|up side by side -> [T, I]. With row_scale = (hidden states [T, N], eps), gate
    and up are first multiplied by each row's 1 / rms(hidden) (the norm before gate|up, its weight folded in)."""
    x = x.contiguous()
    t, n = x.shape[0], x.shape[1] // 2
    y = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    # a program per 1,024 columns keeps a decode batch's few rows spread over the SMs; with many rows (a
    # prefill) a program takes a whole row (up to 16,384 columns), so that a row scale's hidden row is read
    # and reduced once a row, not once a block: at 8,192 rows of 14,336 those re-reads were more than half
    # of the kernel's traffic
    whole_rows = t >= ROWS_WHOLE
    block = min(16384 if whole_rows else 1024, next_pow2(n))
    s = row_scale[0] if row_scale else x
    _silu_and_mul_kernel[(t, div_ceil(n, block))](
        x, y, s, n, x.stride(0), y.stride(0), s.stride(0), row_scale[1] if row_scale else 0.0, BLOCK=block,
        SCALE=row_scale is not None, S_N=s.shape[-1], S_BLOCK=next_pow2(s.shape[-1]),
        num_warps=8 if block > 1024 else 4,
    )  # fmt: skip
    return y
