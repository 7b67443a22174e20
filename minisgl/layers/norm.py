"""RMSNorm, with the residual add folded in so the residual stream is read once per layer."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import use_triton


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x):
        from minisgl.kernel.norm import rms_norm as fused

        return fused(x, weight, eps)
    lib = cpu_kernels.elementwise_lib(x)
    if lib is not None and weight.dtype == x.dtype:
        return cpu_kernels.rms_norm_bf16(lib, x, None, weight, eps)[0]
    # computed in float32 as transformers does, so float32 and bf16 runs match the reference
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def forward_with_residual(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns norm(x + residual) and the new residual x + residual."""
        if residual is not None and use_triton(x):
            from minisgl.kernel.norm import rms_norm_residual

            return rms_norm_residual(x, residual, self.weight, self.eps)
        lib = cpu_kernels.elementwise_lib(x)
        # mixed dtypes promote in torch; the kernel reads bf16 only
        same = self.weight.dtype == x.dtype and (residual is None or residual.dtype == x.dtype)
        if lib is not None and same:
            return cpu_kernels.rms_norm_bf16(lib, x, residual, self.weight, self.eps)
        if residual is not None:
            x = x + residual
        return rms_norm(x, self.weight, self.eps), x
