"""Rotary position embedding (the rotate-half layout Hugging Face checkpoints use)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from minisgl.kernel import cpu as cpu_kernels
from minisgl.kernel import use_triton
from minisgl.layers.norm import RMSNorm

if TYPE_CHECKING:
    from minisgl.attention.base import KVDestination


def _inv_freq(head_dim: int, base: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling {kind!r} is not supported; supported: linear, llama3")


class RotaryEmbedding(nn.Module):
    def __init__(
        self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        inv_freq = _inv_freq(head_dim, base, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        # one table of [cos | sin] per position, gathered by the positions of each step
        self.register_buffer("cos_sin", torch.cat([emb.cos(), emb.sin()], dim=-1), persistent=False)
        self.head_dim = head_dim

    def forward(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor | None = None,
        dest: KVDestination | None = None,
        row_scale: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; positions: [T]. With v and dest (only where `stores_kv(q)`),
        the rotated K and V are written into the pool at dest in the same launch; with row_scale too, q, k
        and v are first scaled by each row's 1 / rms of the hidden states (kernel/rotary.py)."""
        if self.stores_kv(q):
            from minisgl.kernel.rotary import apply_rotary

            return apply_rotary(positions, q, k, self.cos_sin, v=v, dest=dest, row_scale=row_scale)
        if row_scale is not None:
            raise ValueError("the torch rotary does not take a row scale; check stores_kv first")
        if dest is not None:
            raise ValueError("the torch rotary does not store K/V; check stores_kv first")
        lib = cpu_kernels.elementwise_lib(q)
        if lib is not None and k.dtype == q.dtype and q.stride(1) == k.stride(1) == self.head_dim:
            # in place: q and k are views of this layer's own qkv projection output
            return cpu_kernels.rotary_bf16(lib, positions, q, k, self.cos_sin)
        cos, sin = self.cos_sin[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
        return _apply(q, cos, sin), _apply(k, cos, sin)

    def forward_with_qk_norm(
        self,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        q_norm: RMSNorm,
        k_norm: RMSNorm,
        v: torch.Tensor | None = None,
        dest: KVDestination | None = None,
        row_scale: tuple[torch.Tensor, float] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm over each q and k head (Qwen3), then the rotation (and the K/V store, as in forward);
        one launch on CUDA."""
        if self.stores_kv(q) and q_norm.eps == k_norm.eps:
            from minisgl.kernel.rotary import apply_rotary

            norms = (q_norm.weight, k_norm.weight, q_norm.eps)
            return apply_rotary(positions, q, k, self.cos_sin, norms, v, dest, row_scale=row_scale)
        if row_scale is not None:
            raise ValueError("a row scale needs the Triton rotary kernel with one eps for the q and k norms")
        return self.forward(positions, q_norm(q), k_norm(k), v, dest)

    def stores_kv(self, q: torch.Tensor) -> bool:
        """Whether the rotation of q runs in the Triton kernel, which can also store K/V into the pool."""
        half = self.head_dim // 2
        return use_triton(q) and half & (half - 1) == 0  # the kernel's tiles want D/2 a power of 2


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
