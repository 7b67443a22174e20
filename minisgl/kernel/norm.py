"""RMSNorm in one pass, with the residual add folded in: the torch version takes about ten launches."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel.launch import direct_launch, wait_for_inputs
from minisgl.utils.misc import div_ceil, next_pow2


@direct_launch
@triton.jit(do_not_specialize=["n_rows"])  # one compiled kernel for every token count
def _rms_norm_kernel(
    X,
    R,
    Y,
    ROut,
    W,
    n_rows,
    n_inner,
    stride_xo,
    stride_xi,
    stride_r,
    stride_y,
    stride_ro,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RES: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    wait_for_inputs(PDL)
    # row r of the [n_rows, N] view is x[r // n_inner, r % n_inner]: q/k heads are read in place from qkv
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < n_rows
    mask = rmask[:, None] & (cols[None, :] < N)
    x_off = (rows // n_inner) * stride_xo + (rows % n_inner) * stride_xi
    x = tl.load(X + x_off[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = x + r  # added in the input dtype, as the torch version rounds it
        tl.store(ROut + rows[:, None] * stride_ro + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / N
    normed = (xf * tl.rsqrt(var + eps)[:, None]).to(x.dtype)
    w = tl.load(W + cols, mask=cols < N, other=0.0)
    y = (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)


@triton.jit
def row_inv_rms(S, t, stride_s, eps, N: tl.constexpr, BLOCK_N: tl.constexpr):
    """1 / rms of row t of S [T, N] in float32, as the kernel above takes it: the scale of a norm whose weight
    was folded into the projection after it (models/llama.py's `fold_norms`), applied to the projection's
    output by the kernel that reads it (rotary, SiLU)."""
    cols = tl.arange(0, BLOCK_N)
    x = tl.load(S + t.to(tl.int64) * stride_s + cols, mask=cols < N, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 3:
        n_outer, n_inner = x.shape[0], x.shape[1]
        stride_xo, stride_xi = x.stride(0), x.stride(1)
    else:
        x = x if x.dim() == 2 else x.reshape(-1, n)
        n_outer, n_inner = x.shape[0], 1
        stride_xo, stride_xi = x.stride(0), 0
    n_rows = n_outer * n_inner
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(y) if residual is not None else y
    block_n = next_pow2(n)
    rows = max(1, min(16, 2048 // block_n))
    _rms_norm_kernel[(div_ceil(n_rows, rows),)](
        x,
        residual if residual is not None else x,
        y,
        res_out,
        weight,
        n_rows,
        n_inner,
        stride_xo,
        stride_xi,
        n,
        n,
        n,
        eps,
        N=n,
        BLOCK_N=block_n,
        ROWS=rows,
        HAS_RES=residual is not None,
        num_warps=4 if block_n <= 1024 else 8,
    )
    return y, res_out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of a [..., N] tensor (a strided [T, H, D] view is read in place)."""
    shape = x.shape
    y, _ = _launch(x, None, weight, eps)
    return y.view(shape)


def rms_norm_residual(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) for [T, N] tensors, in one pass."""
    residual = residual.contiguous()
    return _launch(x.contiguous(), residual, weight, eps)
