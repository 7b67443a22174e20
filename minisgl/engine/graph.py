"""CUDA graphs for decode: one graph per batch size, batches padded up to the next captured size.

A decode step launches a dozen kernels per layer, each only microseconds long; replaying a graph
removes the launch cost between them. A step's inputs are copied into static buffers on the engine's
stream right before a replay, so the scheduler may build the next batch meanwhile: its rows, positions
and KV slots in one copy (`DecodeGraphInputs`; the graph gathers the token ids from the token pool
itself, and the slots from the page table with pages above a slot), the attention metadata in
another. Padding rows are the dummy request: row `dummy_table_idx` of the page table, which points at
a scratch page of the pool that no request owns.

Off on the CPU (there is nothing to capture), and with cuda_graph_max_bs=0. On a CPU with
MINISGL_EMULATE_GRAPHS the runners work as on CUDA, each graph a `ReplayedForward`: tests check the
runners' data flow there, without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from typing import Any, Protocol

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch, Req, SamplingParams, get_global_ctx
from minisgl.engine.graph_edges import graph_pattern, make_programmatic, name_matcher
from minisgl.env import ENV
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)
_EDGE_WARNINGS: list[str] = []  # the driver's refusals to make an edge programmatic, said once


def default_graph_bs(max_bs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_bs + 1, 16))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


def graphs_possible(device: torch.device) -> bool:
    """CUDA graphs on CUDA; on a CPU only emulated ones (MINISGL_EMULATE_GRAPHS)."""
    return device.type == "cuda" or (device.type == "cpu" and ENV.EMULATE_GRAPHS.value)


class Graph(Protocol):
    def replay(self) -> None: ...

    def pool(self) -> Any: ...


class ReplayedForward:
    """A CUDA graph's stand-in on a CPU (MINISGL_EMULATE_GRAPHS): a replay runs the captured forward again
    on the captured batch, whose tensors are the static buffers a graph reads, and writes the graph's output
    buffer. So a step whose inputs do not all reach the static buffers before the replay gives wrong tokens
    here as on a GPU; what a capture forbids (host reads, allocations outside the pool) it cannot show."""

    def __init__(self, forward: Callable[[], torch.Tensor], batch: Batch, out: torch.Tensor) -> None:
        self.forward, self.batch, self.out = forward, batch, out

    def replay(self) -> None:
        with get_global_ctx().replaying(self.batch):
            self.out.copy_(self.forward())

    def pool(self) -> None:
        return None


def graph_stream(stream: torch.cuda.Stream | None) -> Any:
    """The capture's stream context: none for an emulated graph."""
    return nullcontext() if stream is None else torch.cuda.stream(stream)


def graph_kind(stream: torch.cuda.Stream | None) -> str:
    return "emulated" if stream is None else "CUDA"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def capture_forward(
    forward: Callable[[], torch.Tensor],
    batch: Batch,
    pool: Any,
    stream: torch.cuda.Stream | None,
    short_products: bool = True,
) -> tuple[Graph, torch.Tensor]:
    """A graph of `forward` over `batch` (its inputs in static buffers) and the graph's output buffer; a
    run outside the capture comes first: it compiles and autotunes this shape. Without a stream (a CPU)
    the graph is emulated. `short_products`: the model's products are short enough for programmatic edges
    (graph_edges.short_products)."""
    if stream is None:
        with get_global_ctx().forward_batch(batch):
            forward()
            out = forward()
        return ReplayedForward(forward, batch, out), out
    # the rows the step's products take: a decode graph's requests, a prefill graph's tokens
    pdl = graph_pattern(batch.padded_tokens if batch.is_prefill else batch.size, short_products)
    if pdl:
        from minisgl.kernel.launch import programmatic_launch  # Triton's import: a CUDA run's only

        if not programmatic_launch(stream.device.index or 0):
            pdl = ""
    graph = torch.cuda.CUDAGraph(keep_graph=bool(pdl))
    with get_global_ctx().forward_batch(batch):
        forward()
        torch.cuda.synchronize(stream.device)
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            out = forward()
    if pdl:
        # the edges change before the graph is instantiated (keep_graph defers that to here); a driver without
        # the entry points leaves the edges it has not reached as captured, which is always correct
        try:
            make_programmatic(graph.raw_cuda_graph(), name_matcher(pdl))
        except (RuntimeError, AttributeError) as e:
            if not _EDGE_WARNINGS:
                logger.warning_rank0(f"CUDA graphs keep their edges as captured: {e}")
            _EDGE_WARNINGS.append(str(e))
        graph.instantiate()
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


class DecodeGraphInputs:
    """The one device buffer decode graphs read a step's rows, positions and KV slots from, laid out as
    `make_decode_inputs` lays out the step's packed inputs: a graph of bs rows reads the rows at [0, bs), the
    positions at [q, q + bs) and the slots at [2q, 2q + bs), q = bs rounded up to even. A replay copies the
    step's whole packed tensor in: one copy, where a buffer for each input took three and the token ids'
    gather before them. Without slots in the step's inputs (a page size above one) a graph gathers them
    from the page table instead."""

    def __init__(self, max_bs: int, dummy_table_idx: int, scratch: int, device: torch.device) -> None:
        self.dummy_table_idx, self.scratch = dummy_table_idx, scratch
        # rows, positions, slots, and room for the write columns the step's tensor carries after them
        self.packed = torch.zeros(4 * (max_bs + max_bs % 2), dtype=torch.int64, device=device)

    def views(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A graph of bs rows' rows, positions and slots, set to the dummy row's first position (the scratch
        slot) for its capture."""
        q = bs + bs % 2
        rows, positions, slots = self.packed[:bs], self.packed[q : q + bs], self.packed[2 * q : 2 * q + bs]
        rows.fill_(self.dummy_table_idx)
        positions.zero_()
        slots.fill_(self.scratch)
        return rows, positions, slots

    def load(self, batch: Batch) -> None:
        """A replay's inputs copied in (device to device, on the current stream)."""
        packed = batch.packed_inputs
        assert packed is not None, "a decode step's inputs come packed (Engine.prepare_batch)"
        self.packed[: packed.shape[0]].copy_(packed)


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
        token_pool: torch.Tensor,
        slots_in_inputs: bool,
        short_products: bool = True,
    ) -> None:
        self.device = device
        self.enabled = graphs_possible(device) and max_bs > 0
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
        self.token_pool = token_pool
        # a step's KV slots come in its packed inputs (a slot a page: the scheduler hands them to
        # Engine.prepare_batch), or the graph gathers them from the page table
        self.slots_in_inputs = slots_in_inputs
        self.short_products = short_products  # programmatic edges pay (graph_edges.short_products)
        self.graphs: dict[int, Graph] = {}
        # each graph's output buffer: logits, or the final hidden rows where the LM head runs after the replay
        self.outputs: dict[int, torch.Tensor] = {}
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
    def capture(self, stream: torch.cuda.Stream | None) -> None:
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
        self.inputs = DecodeGraphInputs(max_bs, self.dummy_table_idx, scratch, self.device)
        pool = None
        with graph_stream(stream):
            for bs in reversed(self.bs_list):
                batch = Batch(reqs=[self.dummy_req] * bs, phase="decode")
                rows, batch.positions, slots = self.inputs.views(bs)
                if self.slots_in_inputs:
                    batch.out_loc = slots
                self.attn_backend.prepare_for_capture(batch)
                forward = partial(self._gather_and_forward, batch, rows)
                graph, self.outputs[bs] = capture_forward(forward, batch, pool, stream, self.short_products)
                pool = graph.pool()
                self.graphs[bs] = graph
        self.pool = pool  # the prefill graphs share it
        synchronize(self.device)
        logger.info_rank0(
            f"captured {len(self.graphs)} {graph_kind(stream)} graphs for decode batch sizes up to {max_bs} "
            f"in {time.perf_counter() - start:.1f} s"
        )

    def _gather_and_forward(self, batch: Batch, rows: torch.Tensor) -> torch.Tensor:
        """What a decode graph runs: its token ids gathered at its rows and positions, its KV slots too where
        they do not come with the inputs (the page table holds them by then: the scheduler's cache manager
        wrote them before the replay, in stream order; the dummy row's are the scratch slot), then the model."""
        batch.input_ids = self.token_pool[rows, batch.positions]
        if not self.slots_in_inputs:
            batch.out_loc = get_global_ctx().page_table[rows, batch.positions].to(torch.int64)
        return self.forward()

    def replay(self, batch: Batch) -> torch.Tensor:
        bs = batch.padded_size
        self.inputs.load(batch)
        self.attn_backend.prepare_for_replay(batch)
        self.graphs[bs].replay()
        return self.outputs[bs]

    def destroy(self) -> None:
        self.graphs.clear()
        self.outputs.clear()
