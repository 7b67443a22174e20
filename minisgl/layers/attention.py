"""The attention layer of a decoder: qkv projection, optional per-head q/k norm, rotary, paged attention."""

from __future__ import annotations

import torch
from torch import nn

from minisgl.attention.base import DecodeRope
from minisgl.core import get_global_ctx
from minisgl.distributed import get_tp_info
from minisgl.layers.activation import inv_rms
from minisgl.layers.linear import LinearColParallelMerged, LinearRowParallel
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig


class AttentionLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        info = get_tp_info()
        config.check_tp(info.size)
        d = config.head_dim
        self.layer_id = layer_id
        self.head_dim = d
        self.num_qo_heads = config.num_qo_heads // info.size
        self.num_kv_heads = config.local_kv_heads(info.size)
        q_slice = (info.rank * self.num_qo_heads * d, self.num_qo_heads * d)
        # with fewer KV heads than ranks, neighbouring ranks keep (replicate) the same head
        kv_slice = (info.rank * config.num_kv_heads // info.size * d, self.num_kv_heads * d)
        self.qkv_proj = LinearColParallelMerged(
            config.hidden_size,
            [config.num_qo_heads * d, config.num_kv_heads * d, config.num_kv_heads * d],
            bias=config.attention_bias,
            slices=[q_slice, kv_slice, kv_slice],
        )
        self.o_proj = LinearRowParallel(config.num_qo_heads * d, config.hidden_size)
        self.q_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(d, config.rms_norm_eps) if config.qk_norm else None
        self.rotary = rotary

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, norm_eps: float | None = None
    ) -> torch.Tensor:
        """With norm_eps (a layer whose norms are folded: models/llama.py's `fold_norms`), x is the residual
        stream itself: q|k|v are scaled by its rows' 1 / rms where the rotary kernel reads them, and the
        result is x + o_proj(...), the add in the o projection's epilogue (written over x: see `linear_add`)."""
        ctx = get_global_ctx()
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_qo_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_qo_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        backend, batch = ctx.attn_backend, ctx.batch
        in_kernel = self.rotary.stores_kv(q)  # the rotation runs in a Triton kernel, which can store K/V
        folded = norm_eps is not None
        if in_kernel and backend.fuses_decode_rope(batch, q) and self._same_eps():
            # the rotation, the q/k norm and the K/V store inside the decode kernel: the rotary kernel's launch goes
            norms = self.q_norm is not None and self.k_norm is not None
            rope = DecodeRope(
                k,
                v,
                positions,
                self.rotary.cos_sin,
                batch.out_loc,
                self.q_norm.weight if norms else None,
                self.k_norm.weight if norms else None,
                self.q_norm.eps if norms else 0.0,
                (x, norm_eps) if folded else None,
            )
            out = backend.forward_decode_rope(q, self.layer_id, batch, rope)
            return self.o_proj(out.reshape(-1, q_size), residual=x if folded else None)
        # where the backend allows it, the rotary kernel writes K/V into the pool: one launch fewer
        dest = backend.kv_destination(self.layer_id, batch) if in_kernel else None
        row_scale = None
        if folded:
            if dest is not None and self._same_eps():
                row_scale = (x, norm_eps)
            else:  # no kernel to scale them on the way: scaled here in float32, in place (q, k, v are views)
                qkv.mul_(inv_rms(x, norm_eps))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.rotary.forward_with_qk_norm(
                positions, q, k, self.q_norm, self.k_norm, v, dest, row_scale
            )
        else:
            q, k = self.rotary(positions, q, k, v, dest, row_scale)
        out = backend.forward(q, k, v, self.layer_id, batch, kv_stored=dest is not None)
        return self.o_proj(out.reshape(-1, q_size), residual=x if folded else None)

    def _same_eps(self) -> bool:
        """The kernels take one eps for the q and the k norm (always so in Qwen3's checkpoints)."""
        return self.q_norm is None or self.k_norm is None or self.q_norm.eps == self.k_norm.eps
