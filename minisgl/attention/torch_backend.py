"""The "torch" attention backend: paged KV gathered into a padded batch, one SDPA call per layer.

It runs on any device and is the reference the faster backends are tested against. Requests of a
batch are padded to the longest query and the longest context; a boolean mask keeps each query to
its own causal prefix, so there is no Python loop over requests inside a layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch
from minisgl.kvcache.mha_pool import MHAKVCache
from minisgl.utils.torch_utils import pin


@dataclass
class TorchAttnMetadata:
    kv_index: torch.Tensor  # [B * max_kv] token slots of each request's context, padded
    q_index: torch.Tensor  # [B * max_q] packed row of each padded query (clamped)
    q_valid: torch.Tensor  # [B * max_q] which padded queries are real
    mask: torch.Tensor  # [B, 1, max_q, max_kv] causal + length mask
    batch_size: int
    max_q: int
    max_kv: int


class TorchAttnBackend(BaseAttnBackend):
    def __init__(self, kv_cache: MHAKVCache, page_table: torch.Tensor, device: torch.device) -> None:
        self.kv_cache = kv_cache
        self.page_table = page_table
        self.device = device

    def prepare_metadata(self, batch: Batch) -> None:
        reqs = batch.padded_reqs
        q_lens = [r.extend_len for r in reqs]
        kv_lens = [r.device_len for r in reqs]
        max_q, max_kv, bs = max(q_lens), max(kv_lens), len(reqs)
        on = dict(dtype=torch.int64, pin_memory=pin(self.device))
        rows = torch.tensor([r.table_idx for r in reqs], **on).to(self.device, non_blocking=True)
        q_len_t = torch.tensor(q_lens, **on).to(self.device, non_blocking=True)
        kv_len_t = torch.tensor(kv_lens, **on).to(self.device, non_blocking=True)
        kv_pos = torch.arange(max_kv, device=self.device)
        q_off = torch.arange(max_q, device=self.device)
        kv_index = self.page_table[rows, :max_kv].to(torch.int64)
        kv_index = torch.where(kv_pos < kv_len_t[:, None], kv_index, 0)
        q_start = torch.cumsum(q_len_t, 0) - q_len_t
        q_valid = q_off[None, :] < q_len_t[:, None]
        q_index = torch.where(q_valid, q_start[:, None] + q_off[None, :], 0)
        # query j of request i sits at position (kv_len - q_len + j) and sees kv positions <= it
        q_pos = (kv_len_t - q_len_t)[:, None] + q_off[None, :]
        mask = kv_pos[None, None, :] <= q_pos[:, :, None]
        batch.attn_metadata = TorchAttnMetadata(
            kv_index=kv_index.reshape(-1),
            q_index=q_index.reshape(-1),
            q_valid=q_valid.reshape(-1),
            mask=mask.unsqueeze(1),
            batch_size=bs,
            max_q=max_q,
            max_kv=max_kv,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: Batch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        meta: TorchAttnMetadata = batch.attn_metadata
        out_dtype = q.dtype
        q = q.to(self.kv_cache.attention_dtype(q.dtype))
        if not kv_stored:
            self.kv_cache.store_kv(k, v, batch.out_loc, layer_id)
        bs, max_q, max_kv = meta.batch_size, meta.max_q, meta.max_kv
        num_q, num_kv, d = q.shape[1], k.shape[1], q.shape[2]
        # an FP8 pool's rows come back dequantized: SDPA takes no FP8 operands
        k_all, v_all = self.kv_cache.read_kv(layer_id, meta.kv_index, q.dtype)
        k_all = k_all.view(bs, max_kv, num_kv, d).transpose(1, 2)
        v_all = v_all.view(bs, max_kv, num_kv, d).transpose(1, 2)
        q_pad = q.index_select(0, meta.q_index).view(bs, max_q, num_q, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_pad, k_all, v_all, attn_mask=meta.mask, enable_gqa=num_q != num_kv
        )
        out = out.transpose(1, 2).reshape(bs * max_q, num_q, d)
        if max_q > 1:
            out = out[meta.q_valid]
        return out.to(out_dtype)
