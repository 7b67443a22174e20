"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from minisgl.core import Batch


@dataclass
class KVDestination:
    """Where a layer's K/V rows of this step go: the rotary kernel can write them there in its own pass."""

    k_cache: torch.Tensor  # [slots, Hk, D] the layer's K pool
    v_cache: torch.Tensor
    loc: torch.Tensor  # [T] token slot of each row
    k_scale: torch.Tensor  # one-element float32: an FP8 pool stores x / scale
    v_scale: torch.Tensor


@dataclass
class DecodeRope:
    """The rotary kernel's work for one decode step, done inside the decode kernel (kernel/attention.py)
    instead of a launch of its own (ENV.FUSED_DECODE_ROPE): q comes unrotated, each program rotates its
    heads of q, and the split that holds the new token rotates its K, writes K and V into the pool at
    `loc` and attends to them from registers."""

    k: torch.Tensor  # [B, Hk, D] this step's keys, unrotated (a view of the qkv projection is fine)
    v: torch.Tensor  # [B, Hk, D]
    positions: torch.Tensor  # [B]
    cos_sin: torch.Tensor  # [positions, 2 D]: cos | sin, each D wide with its halves equal
    loc: torch.Tensor  # [B] the pool slot of each new token
    q_weight: torch.Tensor | None = None  # Qwen3's RMSNorm over each q and k head, before the rotation
    k_weight: torch.Tensor | None = None
    eps: float = 0.0
    # (hidden states [B, N], eps): q, k and v are first scaled by each row's 1 / rms(hidden), the norm before
    # the q|k|v projection whose weight was folded into it (models/llama.py's `fold_norms`)
    row_scale: tuple[torch.Tensor, float] | None = None


class BaseAttnBackend(ABC):
    # whether the decode CUDA-graph hooks below are implemented (the warm-up runs eagerly what graphs won't)
    supports_cuda_graphs = False
    # whether a mixed step's decode rows (Batch.num_decode_rows) run the decode kernels, at the variants of their
    # count (the warm-up compiles those where mixed steps are on), rather than with the prompts
    splits_mixed_steps = False
    # whether a prefill step's tokens may be followed by padding tokens of no request (their K/V on the scratch
    # slot, their outputs ignored): the prefill graphs' padding, and an eager step's rounding (prefill_graph.py)
    takes_padded_prefill = False

    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Build whatever the layers need to attend over the paged pool; stored in batch.attn_metadata."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: Batch,
        kv_stored: bool = False,
    ) -> torch.Tensor:
        """Store this step's k/v at batch.out_loc (unless kv_stored: written already, at kv_destination),
        then attend. q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D]."""

    def fuses_decode_rope(self, batch: Batch, q: torch.Tensor) -> bool:
        """Whether forward_decode_rope can take this step: q and k unrotated, K/V not yet stored."""
        return False

    def forward_decode_rope(
        self, q: torch.Tensor, layer_id: int, batch: Batch, rope: DecodeRope
    ) -> torch.Tensor:
        """Decode attention that first does the rotary kernel's work (rotate q and rope.k, after the q/k
        norm where rope has its weights; store K and V at rope.loc). q: [B, Hq, D] unrotated -> [B, Hq, D]."""
        raise NotImplementedError(f"{type(self).__name__} does not rotate inside decode attention")

    def decode_variant(self, batch_size: int) -> Hashable:
        """What picks the compiled variant of this backend's decode kernels for a batch of this many rows:
        the start-up warm-up runs one eager decode step for each value it takes (engine/warmup.py). One
        variant for every size unless a backend says otherwise."""
        return None

    def kv_destination(self, layer_id: int, batch: Batch) -> KVDestination | None:
        """Where the rotary kernel may store this step's K/V instead of this backend; None: the backend
        stores them itself (its pool layout or dtype is one the rotary kernel does not write)."""
        return None

    # CUDA-graph hooks: a backend that supports graphs keeps its metadata in static buffers
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    # prefill graphs (engine/prefill_graph.py): static metadata for `max_reqs` requests
    def init_prefill_capture(self, max_reqs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support prefill CUDA graphs")

    def prepare_for_prefill_capture(self, batch: Batch, tokens: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support prefill CUDA graphs")

    def prepare_for_prefill_replay(self, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support prefill CUDA graphs")
