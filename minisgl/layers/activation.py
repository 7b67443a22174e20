"""Gated activations of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x holds gate|up side by side; returns silu(gate) * up. bf16 on a CPU takes one C pass instead of
    torch's two ops (80 against 100 us for 64 rows of the default model's MLP on an AVX512-BF16 CPU
    without AMX)."""
    if use_triton(x) and x.dim() == 2:
        from minisgl.kernel.activation import silu_and_mul as fused

        return fused(x)
    lib = cpu_kernels.elementwise_lib(x)
    if lib is not None and x.dim() == 2 and x.stride(1) == 1:
        return cpu_kernels.silu_and_mul_bf16(lib, x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
