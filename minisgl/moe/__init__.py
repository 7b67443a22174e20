"""MoE backends by name; the experts layer picks "triton" on CUDA (or anywhere with MINISGL_KERNELS=triton) and
"torch" elsewhere unless told otherwise."""

from __future__ import annotations

import torch

from minisgl.kernel import triton_everywhere
from minisgl.moe.base import BaseMoeBackend, select_experts

MOE_BACKENDS = ("auto", "torch", "triton")


def create_moe_backend(name: str, device: torch.device) -> BaseMoeBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" or triton_everywhere() else "torch"
    if name == "torch":
        from minisgl.moe.torch_backend import TorchMoeBackend

        return TorchMoeBackend()
    if name == "triton":
        from minisgl.moe.triton_backend import TritonMoeBackend

        return TritonMoeBackend()
    raise ValueError(f"MoE backend {name!r} is unknown; use one of {', '.join(MOE_BACKENDS)}")


__all__ = ["BaseMoeBackend", "create_moe_backend", "select_experts"]
