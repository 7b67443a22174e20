"""The paged KV pool: one K and one V buffer per layer, indexed by token slot (page * page_size + offset)."""

from __future__ import annotations

import math

import numpy as np
import torch


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # numpy's zeros takes fresh zero pages from the OS (calloc): a large pool costs nothing until it is used
    blob = torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8))
    return blob.view(dtype).view(shape)


class MHAKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        # zeroed, so padded reads in attention never meet NaN bit patterns
        self.k_buffer = _zeros(shape, dtype, device)
        self.v_buffer = _zeros(shape, dtype, device)

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        self.k_buffer[layer_id].index_copy_(0, out_loc, k)
        self.v_buffer[layer_id].index_copy_(0, out_loc, v)
