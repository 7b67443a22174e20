"""CUDA graphs for decode: one graph per batch size, batches padded up to the next captured size.

Off on the CPU (there is nothing to capture), and with cuda_graph_max_bs=0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)


def default_graph_bs(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class GraphRunner:
    def __init__(
        self,
        device: torch.device,
        max_bs: int,
        bs_list: list[int] | None,
        attn_backend: BaseAttnBackend,
        forward: Callable[[], torch.Tensor],
        dummy_table_idx: int,
        max_seq_len: int,
        vocab_size: int,
    ) -> None:
        self.device = device
        self.enabled = device.type == "cuda" and max_bs > 0
        self.bs_list = sorted(bs_list) if bs_list else default_graph_bs(max_bs) if self.enabled else []
        self.max_bs = self.bs_list[-1] if self.bs_list else 0
        self.attn_backend = attn_backend
        self.forward = forward
        self.dummy_table_idx = dummy_table_idx
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.dummy_req = Req(
            input_ids=[0],
            table_idx=dummy_table_idx,
            cached_len=0,
            output_len=1,
            uid=-1,
            sampling_params=SamplingParams(max_tokens=1),
            cache_handle=None,
            seed=0,
        )

    def can_use(self, batch: Batch) -> bool:
        return self.enabled and batch.is_decode and batch.padded_size in self.graphs

    def padded_size(self, bs: int) -> int:
        return next((s for s in self.bs_list if s >= bs), bs)

    def pad_batch(self, batch: Batch) -> None:
        """A decode batch that will replay a graph gets dummy requests up to the captured size."""
        if not self.graphs or not batch.is_decode or batch.size > self.max_bs:
            return
        extra = self.padded_size(batch.size) - batch.size
        batch.padded_reqs = batch.reqs + [self.dummy_req] * extra

    def capture(self) -> None:
        raise NotImplementedError("CUDA graph capture arrives with the GPU fast path")

    def replay(self, batch: Batch) -> torch.Tensor:
        raise NotImplementedError("CUDA graph replay arrives with the GPU fast path")
