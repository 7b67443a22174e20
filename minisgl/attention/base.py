"""The interface every attention backend implements."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from minisgl.core import Batch


class BaseAttnBackend(ABC):
    @abstractmethod
    def prepare_metadata(self, batch: Batch) -> None:
        """Build whatever the layers need to attend over the paged pool; stored in batch.attn_metadata."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, batch: Batch
    ) -> torch.Tensor:
        """Store this step's k/v at batch.out_loc, then attend. q: [T, Hq, D], k/v: [T, Hk, D] -> [T, Hq, D]."""

    # CUDA-graph hooks: a backend that supports graphs keeps its metadata in static buffers
    def init_capture_graph(self, max_seq_len: int, bs_list: list[int]) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_capture(self, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, batch: Batch) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")
