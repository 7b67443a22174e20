"""Attention backends by name; "auto" is "triton" on CUDA (or anywhere with MINISGL_KERNELS=triton), and on
the CPU "cpu" where its C kernel builds, else "torch"."""

from __future__ import annotations

import torch

from minisgl.attention.base import BaseAttnBackend, KVDestination
from minisgl.kernel import triton_everywhere
from minisgl.kvcache.mha_pool import MHAKVCache


def create_attn_backend(
    name: str,
    kv_cache: MHAKVCache,
    page_table: torch.Tensor,
    device: torch.device,
    group: int | None = None,
) -> BaseAttnBackend:
    """`group`: the model's query heads a KV head on this rank, where known (the Triton backend then compiles
    only the CUDA decode kernels that take it)."""
    if name == "auto":
        name = "triton" if device.type == "cuda" or triton_everywhere() else "cpu"
    if name == "cpu":
        from minisgl.kernel.cpu import library

        lib = library() if device.type == "cpu" else None
        if lib is not None:
            from minisgl.attention.cpu_backend import CpuAttnBackend

            return CpuAttnBackend(kv_cache, page_table, device, lib)
        # without a C compiler the torch backend does the same work, slower
        name = "torch"
    if name == "torch":
        from minisgl.attention.torch_backend import TorchAttnBackend

        return TorchAttnBackend(kv_cache, page_table, device)
    if name == "triton":
        from minisgl.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(kv_cache, page_table, device, group)
    raise ValueError(f"attention backend {name!r} is unknown; use one of auto, cpu, torch, triton")


__all__ = ["BaseAttnBackend", "KVDestination", "create_attn_backend"]
