"""The "cpu" attention backend: decode and prefill read K/V in place from the paged pool with C kernels.

A decode step's query of each request attends over its context through the page table, as the
Triton kernel does on a GPU: nothing is gathered or padded, so the cost is one read of the context.
Prefill (and extend over a cached prefix) is a causal flash-attention kernel over the same pool:
each request's query rows in blocks, its keys in tiles, the softmax kept online, so no padded batch
and no [queries, context] mask (torch's SDPA over the padded batch took 7.3 ms a layer for a
500-token bf16 prompt of the default model; the kernel 1.2). In bf16 it rounds what SDPA rounds, so
the greedy tokens stay the torch path's (up to near-ties; attention.c says how close). Both kernels
read float32, bf16 and FP8 pools; an FP8 pool's values are decoded in the loops and its per-layer
scales applied to the scores and the output.

The torch backend stays the reference the tests compare with, and runs the prefill of a head_dim
that is not a multiple of 16 (the kernel's vectors are 16 floats).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch
from minisgl.kernel.cpu import decode_attention, prefill_attention
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.utils.torch_utils import int_tensor


@dataclass
class CpuDecodeMetadata:
    rows: torch.Tensor  # [B] int64 page-table row of each request
    seq_lens: torch.Tensor  # [B] int64 context length after this step (device_len)


@dataclass
class CpuPrefillMetadata:
    rows: torch.Tensor  # [B] int64 page-table row of each request
    prefix_lens: torch.Tensor  # [B] int64 tokens already in the pool (cached_len)
    extend_lens: torch.Tensor  # [B] int64 this step's tokens: the request's rows of the packed batch
    # a mixed step's decode rows (Batch.num_decode_rows), for the decode kernel, which reads a KV head once for its
    # query heads; the requests above are those before them
    decode: CpuDecodeMetadata | None = None


class CpuAttnBackend(TorchAttnBackend):
    splits_mixed_steps = True

    def __init__(
        self, kv_cache: MHAKVCache, page_table: torch.Tensor, device: torch.device, lib: ctypes.CDLL
    ) -> None:
        super().__init__(kv_cache, page_table, device)
        self.lib = lib
        self.scale = kv_cache.head_dim**-0.5
        self.prefill_in_c = kv_cache.head_dim % 16 == 0

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        # one flat list through int_tensor: torch.tensor of nested lists took 40 us a decode step of 256 rows
        if batch.is_decode:
            meta = int_tensor([r.table_idx for r in reqs] + [r.device_len for r in reqs]).view(2, -1)
            batch.attn_metadata = CpuDecodeMetadata(meta[0], meta[1])
        elif self.prefill_in_c:
            # a prefill graph's replay (emulated on a CPU) pads the requests: it keeps the prefill kernel for all
            split = len(reqs) - (0 if batch.padded_tokens else batch.num_decode_rows)
            head, tail = reqs[:split], reqs[split:]
            flat = [r.table_idx for r in head] + [r.cached_len for r in head] + [r.extend_len for r in head]
            meta = int_tensor(flat).view(3, -1)
            batch.attn_metadata = CpuPrefillMetadata(meta[0], meta[1], meta[2])
            if tail:
                dec = int_tensor([r.table_idx for r in tail] + [r.device_len for r in tail]).view(2, -1)
                batch.attn_metadata.decode = CpuDecodeMetadata(dec[0], dec[1])
        else:
            super().prepare_metadata(batch)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: Batch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        meta = batch.attn_metadata
        kv = self.kv_cache
        if isinstance(meta, CpuPrefillMetadata):
            return self._prefill(q, k, v, layer_id, batch, kv_stored)
        if not batch.is_decode:
            # a head_dim the prefill kernel does not take: metadata and attention are the torch backend's
            return super().forward(q, k, v, layer_id, batch, kv_stored)
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

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch, kv_stored: bool
    ) -> torch.Tensor:
        """As the torch backend: store this step's K/V (unless the rotary kernel did), then each query row
        attends over its request's pool slots up to its own position (cached prefix included)."""
        meta: CpuPrefillMetadata = batch.attn_metadata
        kv = self.kv_cache
        if not kv_stored:
            kv.store_kv(k, v, batch.out_loc, layer_id)
        scales = (self.scale, kv.k_scales[layer_id], kv.v_scales[layer_id])
        pool = (kv.k_cache(layer_id), kv.v_cache(layer_id), self.page_table)
        # the decode rows are the packed batch's last tokens, one a request
        num_decode = 0 if meta.decode is None else meta.decode.rows.shape[0]
        parts: list[torch.Tensor] = []
        if meta.rows.shape[0]:
            head = q[: q.shape[0] - num_decode]
            parts.append(
                prefill_attention(
                    self.lib, head, *pool, meta.rows, meta.prefix_lens, meta.extend_lens, *scales
                )
            )
        if meta.decode is not None:
            tail = q[q.shape[0] - num_decode :]
            parts.append(
                decode_attention(self.lib, tail, *pool, meta.decode.rows, meta.decode.seq_lens, *scales)
            )
        out = parts[0] if len(parts) == 1 else torch.cat([p.to(q.dtype) for p in parts])
        return out.to(q.dtype)
