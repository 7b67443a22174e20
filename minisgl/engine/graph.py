"""CUDA graphs for decode: one graph per batch size, batches padded up to the next captured size.

A decode step launches a dozen kernels per layer, each only microseconds long; replaying a graph
removes the launch cost between them. Inputs (token ids, positions, KV slots, attention metadata)
are copied into static buffers on the engine's stream right before a replay, so the scheduler may
build the next batch meanwhile. Padding rows are the dummy request: row `dummy_table_idx` of the
page table, which points at a scratch page of the pool that no request owns.

Off on the CPU (there is nothing to capture), and with cuda_graph_max_bs=0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch, Req, SamplingParams, get_global_ctx
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)


def default_graph_bs(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def capture_forward(
    forward: Callable[[], torch.Tensor], batch: Batch, pool: Any, stream: torch.cuda.Stream
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of `forward` over `batch` (its inputs in static buffers) and the graph's output buffer; a
    run outside the capture comes first: it compiles and autotunes this shape."""
    graph = torch.cuda.CUDAGraph()
    with get_global_ctx().forward_batch(batch):
        forward()
        torch.cuda.synchronize(stream.device)
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = forward()
    return graph, out


def dummy_req(table_idx: int, cached_len: int = 0) -> Req:
    """A request of one token on the dummy row, which pads captured batches: with cached_len 0 a decode
    step computes its token (into the scratch slot), with 1 a prefill step has nothing to compute for it."""
    return Req(
        input_ids=[0],
        table_idx=table_idx,
        cached_len=cached_len,
        output_len=1,
        uid=-1,
        sampling_params=SamplingParams(max_tokens=1),
        cache_handle=None,
        seed=0,
    )


class StaticInputs:
    """The device buffers a captured graph reads a step's token ids, positions and KV slots from; until a
    step's are copied in, every slot is the scratch slot (the dummy row's), which no request reads."""

    def __init__(self, n: int, scratch: int, device: torch.device) -> None:
        self.input_ids = torch.zeros(n, dtype=torch.int32, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_loc = torch.full((n,), scratch, dtype=torch.int64, device=device)

    def bind(self, batch: Batch, n: int) -> None:
        """The capture's batch reads the first n of each buffer."""
        batch.input_ids = self.input_ids[:n]
        batch.positions = self.positions[:n]
        batch.out_loc = self.out_loc[:n]

    def load(self, batch: Batch, n: int) -> None:
        """A replay's inputs copied in (device to device, on the current stream)."""
        self.input_ids[:n].copy_(batch.input_ids)
        self.positions[:n].copy_(batch.positions)
        self.out_loc[:n].copy_(batch.out_loc)


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
        if bs_list:
            bs_list = [s for s in bs_list if 0 < s <= max_bs]
        self.bs_list = sorted(bs_list) if bs_list else default_graph_bs(max_bs) if self.enabled else []
        self.enabled = self.enabled and bool(self.bs_list)
        self.max_bs = self.bs_list[-1] if self.bs_list else 0
        self.attn_backend = attn_backend
        self.forward = forward
        self.dummy_table_idx = dummy_table_idx
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool: object | None = None  # the captured graphs' memory pool
        self.dummy_req = dummy_req(dummy_table_idx)

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

    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream) -> None:
        """Capture one graph per batch size, largest first so the smaller ones reuse its memory pool."""
        if not self.enabled:
            return
        try:
            self.attn_backend.init_capture_graph(self.max_seq_len, self.bs_list)
        except NotImplementedError as e:
            logger.info_rank0(f"decode runs without CUDA graphs: {e}")
            self.enabled = False
            return
        start = time.perf_counter()
        max_bs = self.max_bs
        # the dummy request's one token sits at position 0 of its row: the scratch slot
        scratch = int(get_global_ctx().page_table[self.dummy_table_idx, 0].item())
        self.inputs = StaticInputs(max_bs, scratch, self.device)
        pool = None
        with torch.cuda.stream(stream):
            for bs in reversed(self.bs_list):
                batch = Batch(reqs=[self.dummy_req] * bs, phase="decode")
                self.inputs.bind(batch, bs)
                self.attn_backend.prepare_for_capture(batch)
                graph, self.logits[bs] = capture_forward(self.forward, batch, pool, stream)
                pool = graph.pool()
                self.graphs[bs] = graph
        self.pool = pool  # the prefill graphs share it
        torch.cuda.synchronize(self.device)
        logger.info_rank0(
            f"captured {len(self.graphs)} CUDA graphs for decode batch sizes up to {max_bs} "
            f"in {time.perf_counter() - start:.1f} s"
        )

    def replay(self, batch: Batch) -> torch.Tensor:
        bs = batch.padded_size
        self.inputs.load(batch, bs)
        self.attn_backend.prepare_for_replay(batch)
        self.graphs[bs].replay()
        return self.logits[bs]

    def destroy(self) -> None:
        self.graphs.clear()
        self.logits.clear()
