"""The "cpu" attention backend: decode reads K/V in place from the paged pool with a C kernel.

A decode step's query of each request attends over its context through the page table, as the
Triton kernel does on a GPU: nothing is gathered or padded, so the cost is one read of the context.
Prefill (and extend over a cached prefix) is the torch backend's, which stays the reference.
The kernel reads float32, bf16 and FP8 pools; an FP8 pool's values are decoded in the loops and its
per-layer scales applied to the scores and the output.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch
from minisgl.kernel.cpu import decode_attention
from minisgl.kvcache.mha_pool import MHAKVCache


@dataclass
class CpuDecodeMetadata:
    rows: torch.Tensor  # [B] int64 page-table row of each request
    seq_lens: torch.Tensor  # [B] int64 context length after this step (device_len)


class CpuAttnBackend(TorchAttnBackend):
    def __init__(
        self, kv_cache: MHAKVCache, page_table: torch.Tensor, device: torch.device, lib: ctypes.CDLL
    ) -> None:
        super().__init__(kv_cache, page_table, device)
        self.lib = lib
        self.scale = kv_cache.head_dim**-0.5

    def prepare_metadata(self, batch: Batch) -> None:
        if not batch.is_decode:
            return super().prepare_metadata(batch)
        reqs = batch.padded_reqs
        meta = torch.tensor([[r.table_idx for r in reqs], [r.device_len for r in reqs]], dtype=torch.int64)
        batch.attn_metadata = CpuDecodeMetadata(meta[0], meta[1])

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: Batch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        if not batch.is_decode:
            return super().forward(q, k, v, layer_id, batch, kv_stored)
        meta: CpuDecodeMetadata = batch.attn_metadata
        kv = self.kv_cache
        if torch.compiler.is_compiling():
            # a compiled step (engine/cpu_compile.py): the store and the kernel as one traceable op
            out = torch.ops.minisgl.cpu_decode_attention(
                q,
                k,
                v,
                kv.k_buffer,
                kv.v_buffer,
                layer_id,
                batch.out_loc,
                self.page_table,
                meta.rows,
                meta.seq_lens,
                self.scale,
                kv.k_scales[layer_id],
                kv.v_scales[layer_id],
            )
            return out.to(q.dtype)
        if not kv_stored:
            kv.store_kv(k, v, batch.out_loc, layer_id)
        out = decode_attention(
            self.lib,
            q,
            kv.k_cache(layer_id),
            kv.v_cache(layer_id),
            self.page_table,
            meta.rows,
            meta.seq_lens,
            self.scale,
            kv.k_scales[layer_id],
            kv.v_scales[layer_id],
        )
        return out.to(q.dtype)
