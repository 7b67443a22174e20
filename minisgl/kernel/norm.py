"""RMSNorm in one pass, with the residual add folded in: the torch version takes about ten launches.

With `prefetch` (a weight), programs beyond the norm's own ask that weight into L2 for the GEMM that
reads the norm's output next (kernel/prefetch.py)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from minisgl.kernel.launch import direct_launch
from minisgl.kernel.prefetch import BLOCK as PREFETCH_BLOCK
from minisgl.kernel.prefetch import as_bytes, prefetch_part, prefetch_programs
from minisgl.utils.misc import div_ceil, next_pow2


@direct_launch
@triton.jit(do_not_specialize=["n_rows", "p_bytes", "norm_programs"])  # one kernel for every token count
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
    P,
    p_bytes,
    norm_programs,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS: tl.constexpr,
    HAS_RES: tl.constexpr,
    PREFETCH: tl.constexpr,
    P_BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    if PREFETCH:
        if pid >= norm_programs:
            prefetch_part(P, p_bytes, pid - norm_programs, tl.num_programs(0) - norm_programs, P_BLOCK)
        else:
            _rms_norm_rows(
                X,
                R,
                Y,
                ROut,
                W,
                pid,
                n_rows,
                n_inner,
                stride_xo,
                stride_xi,
                stride_r,
                stride_y,
                stride_ro,
                eps,
                N,
                BLOCK_N,
                ROWS,
                HAS_RES,
            )
    else:
        _rms_norm_rows(
            X,
            R,
            Y,
            ROut,
            W,
            pid,
            n_rows,
            n_inner,
            stride_xo,
            stride_xi,
            stride_r,
            stride_y,
            stride_ro,
            eps,
            N,
            BLOCK_N,
            ROWS,
            HAS_RES,
        )


@triton.jit
def _rms_norm_rows(
    X,
    R,
    Y,
    ROut,
    W,
    pid,
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
):
    # row r of the [n_rows, N] view is x[r // n_inner, r % n_inner]: q/k heads are read in place from qkv
    rows = pid * ROWS + tl.arange(0, ROWS)
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


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    prefetch: torch.Tensor | None = None,
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
    programs = div_ceil(n_rows, rows)
    extra, p_bytes, p = 0, 0, x
    if prefetch is not None and n_rows > 0:
        extra, p = prefetch_programs(x.device.index or 0), as_bytes(prefetch)
        p_bytes = p.numel()
    _rms_norm_kernel[(programs + extra,)](
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
        p,
        p_bytes,
        programs,
        N=n,
        BLOCK_N=block_n,
        ROWS=rows,
        HAS_RES=residual is not None,
        PREFETCH=extra > 0,
        P_BLOCK=PREFETCH_BLOCK,
        num_warps=4 if block_n <= 1024 else 8,
    )
    return y, res_out


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, prefetch: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of a [..., N] tensor (a strided [T, H, D] view is read in place);
    `prefetch`: a CUDA weight to ask into L2 for the next GEMM."""
    shape = x.shape
    y, _ = _launch(x, None, weight, eps, prefetch)
    return y.view(shape)


def rms_norm_residual(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    prefetch: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x + residual), x + residual) for [T, N] tensors, in one pass."""
    residual = residual.contiguous()
    return _launch(x.contiguous(), residual, weight, eps, prefetch)
