"""Attention backends by name; the engine picks "torch" on CPU and "triton" on CUDA unless told otherwise."""

from __future__ import annotations

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.kvcache.mha_pool import MHAKVCache


def create_attn_backend(
    name: str, kv_cache: MHAKVCache, page_table: torch.Tensor, device: torch.device
) -> BaseAttnBackend:
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        from minisgl.attention.torch_backend import TorchAttnBackend

        return TorchAttnBackend(kv_cache, page_table, device)
    if name == "triton":
        from minisgl.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(kv_cache, page_table, device)
    raise ValueError(f"attention backend {name!r} is unknown; use one of auto, torch, triton")


__all__ = ["BaseAttnBackend", "create_attn_backend"]
