"""The paged KV pool: one K and one V buffer per layer, indexed by token slot (page * page_size + offset).

An FP8 pool (torch.float8_e4m3fn) stores clamp(x / scale, ±448) with one float32 scale per layer for K
and one for V, and is read back as stored * scale: half the bytes of bf16 a token, so twice the pages
in the same memory and half the bytes each decode step reads.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence

import numpy as np
import torch

from minisgl.kvcache.prefault import PoolPrefaulter

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value; the cast itself does not saturate


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if hasattr(mmap, "MADV_HUGEPAGE") and nbytes >= 1 << 21:
        # Fresh zero pages from the OS, as 2 MB pages: a large pool costs nothing until it is used, and a
        # slot's first write costs one fault a 2 MB page, not one a 4 KB page (storing 500 tokens' K/V
        # of 30 layers into untouched pool memory: 148 ms of 4 KB faults on a VM here, 4.6 ms)
        area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        area.madvise(mmap.MADV_HUGEPAGE)
        # frombuffer keeps `area` alive as long as the tensor
        return torch.frombuffer(area, dtype=torch.uint8).view(dtype).view(shape)
    # numpy's zeros takes fresh zero pages from the OS (calloc)
    blob = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    return blob.view(dtype).view(shape)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale in e4m3fn, clamped to its finite range (the torch reference of the Triton store)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def write_kv(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out_loc: torch.Tensor,
    k_scale: torch.Tensor | float,
    v_scale: torch.Tensor | float,
) -> None:
    """Write K/V rows at the token slots out_loc of one layer's buffers, cast (for FP8, scaled) to their dtype."""
    if k_buf.dtype == FP8_DTYPE:
        # index_copy_ has no float8 kernel on the CPU: the bytes are copied as bytes
        k_buf.view(torch.uint8).index_copy_(0, out_loc, quantize_fp8(k, k_scale).view(torch.uint8))
        v_buf.view(torch.uint8).index_copy_(0, out_loc, quantize_fp8(v, v_scale).view(torch.uint8))
        return
    k_buf.index_copy_(0, out_loc, k.to(k_buf.dtype))
    v_buf.index_copy_(0, out_loc, v.to(v_buf.dtype))


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
        k_scales: Sequence[float] | None = None,
        v_scales: Sequence[float] | None = None,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.is_fp8 = dtype == FP8_DTYPE
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        # zeroed, so padded reads in attention never meet NaN bit patterns
        self.k_buffer = _zeros(shape, dtype, device)
        self.v_buffer = _zeros(shape, dtype, device)
        if not self.is_fp8 and (k_scales is not None or v_scales is not None):
            raise ValueError(f"KV scales apply to an FP8 pool only; this pool stores {dtype}")
        # kept on the host for the CPU kernel and on the device for the Triton kernels, which read them in place
        self.k_scales = [float(s) for s in k_scales] if k_scales is not None else [1.0] * num_layers
        self.v_scales = [float(s) for s in v_scales] if v_scales is not None else [1.0] * num_layers
        if len(self.k_scales) != num_layers or len(self.v_scales) != num_layers:
            raise ValueError(f"one K and one V scale per layer are needed: {num_layers} layers")
        self.k_scale = torch.tensor(self.k_scales, dtype=torch.float32, device=device)
        self.v_scale = torch.tensor(self.v_scales, dtype=torch.float32, device=device)
        # a CPU pool's memory is mapped ahead of the pages in use, off the step's path (prefault.py says why)
        self.prefaulter = (
            PoolPrefaulter([self.k_buffer, self.v_buffer], num_pages, page_size)
            if device.type == "cpu"
            else None
        )

    def will_use(self, page: int) -> None:
        """The scheduler has handed out `page` (pages go lowest first): map a CPU pool's memory ahead of it."""
        if self.prefaulter is not None:
            self.prefaulter.advance(page)

    def close(self) -> None:
        if self.prefaulter is not None:
            self.prefaulter.close()

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return 2 * num_layers * page_size * num_kv_heads * head_dim * dtype.itemsize

    def k_cache(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def scales(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's K and V scale as one-element device tensors (views: a CUDA graph reads them live)."""
        return self.k_scale[layer_id : layer_id + 1], self.v_scale[layer_id : layer_id + 1]

    def store_kv(self, k: torch.Tensor, v: torch.Tensor, out_loc: torch.Tensor, layer_id: int) -> None:
        """Write this step's K/V rows at out_loc, cast (and, for FP8, scaled) to the pool's dtype."""
        k_scale, v_scale = self.scales(layer_id) if self.is_fp8 else (1.0, 1.0)
        write_kv(self.k_buffer[layer_id], self.v_buffer[layer_id], k, v, out_loc, k_scale, v_scale)

    def read_kv(
        self, layer_id: int, index: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V rows at the token slots `index`, in `dtype`; an FP8 pool's rows dequantized."""
        k_buf, v_buf = self.k_buffer[layer_id], self.v_buffer[layer_id]
        if not self.is_fp8:
            return k_buf.index_select(0, index).to(dtype), v_buf.index_select(0, index).to(dtype)
        # gathered as bytes, as they are stored: not every device has float8 gather kernels
        k = k_buf.view(torch.uint8).index_select(0, index).view(FP8_DTYPE)
        v = v_buf.view(torch.uint8).index_select(0, index).view(FP8_DTYPE)
        k_scale, v_scale = self.scales(layer_id)
        return (k.float() * k_scale).to(dtype), (v.float() * v_scale).to(dtype)

    def attention_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The dtype attention computes in: the pool's, or the model's for an FP8 pool (read and dequantized)."""
        return model_dtype if self.is_fp8 else self.dtype
