"""Gated activations of the MLP."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minisgl.kernel import use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x holds gate|up side by side; returns silu(gate) * up."""
    if use_triton(x) and x.dim() == 2:
        from minisgl.kernel.activation import silu_and_mul as fused

        return fused(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
