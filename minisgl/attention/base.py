"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
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


class BaseAttnBackend(ABC):
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
