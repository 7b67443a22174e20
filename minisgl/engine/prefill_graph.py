"""CUDA graphs for small prefill steps: one graph per token count, steps padded up to the next one.

A prefill step launches about 260 kernels from the host, each through a Python call of 10-40 us, so a
short prompt's first token waits on the host, not the GPU: on an H200 a 16-token and a 1,024-token
prompt both took about 15-20 ms to their first token, and take 2.5 and 6 ms from graphs
(docs/benchmarks.md, "Prefill graphs"). Here a step of up to `max_tokens` tokens and `max_reqs`
requests replays a graph captured for the next token count up.

How a step is padded so that one graph serves every such step:
- its requests are followed by empty ones (no query this step: the extend kernel returns at once for
  them) up to `max_reqs`, so the attention metadata and the rows whose logits are kept have fixed sizes;
- its tokens are followed by padding tokens up to the graph's count that belong to no request: they
  read the dummy row of the token pool and page table (every slot of that row is the scratch slot no
  request owns), so their K/V land there, and no request's attention reads their rows.
Static buffers take the step's inputs by device-to-device copies before the replay, on the engine's
stream, as for the decode graphs (graph.py).

Off on the CPU (emulated there with MINISGL_EMULATE_GRAPHS, as graph.py says), with
cuda_graph_max_prefill=0, for steps that ask for prompt logprobs (their logits rows vary), and for
attention backends without static prefill metadata.

The steps that run eagerly (more requests or tokens than a graph takes) are padded the same way, without empty
requests, to the graphs' token counts continued past the largest (every MINISGL_PREFILL_ROUND, 256, tokens):
cuBLAS chooses its kernels for each row count it has not multiplied before, 200-300 us of the host's time for
each of a step's products, so a burst of short prompts, whose steps' token counts are new each time, waited on
the host (docs/benchmarks.md, "A burst of short prompts on a GPU"). Not for mixed steps (their decode rows are
split off by count) nor prompt logprobs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.core import Batch, get_global_ctx
from minisgl.engine.graph import (
    Graph,
    capture_forward,
    dummy_req,
    graph_kind,
    graph_stream,
    graphs_possible,
    synchronize,
)
from minisgl.env import ENV
from minisgl.utils.logger import init_logger

logger = init_logger(__name__)

# requests a graphed prefill step may hold (a multiple of 4: the metadata rows stay 16-byte aligned)
MAX_REQS = 8
# the largest graphed step's tokens when the configuration leaves it to the engine (docs/benchmarks.md)
DEFAULT_MAX_TOKENS = 2048


def default_token_counts(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 256, then every 256 up to max_tokens (and max_tokens itself): a step pads to at
    most twice its tokens, and above 256 by at most 255 (the GPU time of padding grows with the count)."""
    counts, n = [], 16
    while n < max_tokens:
        counts.append(n)
        n = n * 2 if n < 256 else n + 256
    return sorted(set(counts) | {max_tokens}) if max_tokens > 0 else []


def rounded_tokens(tokens: int, step: int) -> int:
    """An eager prefill step's padded token count: the graphs' counts (16, 32, ... doubling up to `step`, then
    every `step`), so that a step pads to the same count whether graphs run or not and its products are the
    same kernels either way."""
    n = 16
    while n < tokens and n < step:
        n *= 2
    return n if n >= tokens else -(-tokens // step) * step


def rounded_counts(limit: int, step: int) -> list[int]:
    """Every count `rounded_tokens` gives for a step of 1 to `limit` tokens."""
    counts, tokens = [], 1
    while tokens <= limit:  # the rounding never goes down: the next count starts after this one
        counts.append(rounded_tokens(tokens, step))
        tokens = counts[-1] + 1
    return counts


class StaticInputs:
    """The device buffers a captured prefill graph reads a step's token ids, positions and KV slots from;
    until a step's are copied in, every slot is the scratch slot (the dummy row's), which no request reads."""

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


class PrefillGraphRunner:
    def __init__(
        self,
        device: torch.device,
        max_tokens: int | None,
        attn_backend: BaseAttnBackend,
        forward: Callable[[], torch.Tensor],
        dummy_table_idx: int,
        scratch_row: bool = True,
        short_products: bool = True,
    ) -> None:
        """`scratch_row`: every slot of the page table's row `dummy_table_idx` is the scratch slot (the engine keeps
        one where decode graphs run); without it no step is padded, eager or not (a padding token's K/V would land
        in a request's slot)."""
        if max_tokens is None:
            max_tokens = DEFAULT_MAX_TOKENS
        self.enabled = graphs_possible(device) and max_tokens > 0
        # eager steps' padding where graphs run at all, with a backend that takes padding tokens
        pads = (
            scratch_row and graphs_possible(device) and getattr(attn_backend, "takes_padded_prefill", False)
        )
        self.eager_round = max(0, int(ENV.PREFILL_ROUND.value)) if pads else 0
        self.device = device
        self.token_counts = default_token_counts(max_tokens) if self.enabled else []
        self.max_tokens = self.token_counts[-1] if self.token_counts else 0
        self.max_reqs = MAX_REQS
        self.attn_backend = attn_backend
        self.forward = forward
        self.dummy_table_idx = dummy_table_idx
        self.empty_req = dummy_req(dummy_table_idx, cached_len=1)  # extend_len 0
        self.short_products = short_products  # programmatic edges pay (graph_edges.short_products)
        self.graphs: dict[int, Graph] = {}
        self.logits: dict[int, torch.Tensor] = {}

    def padded_tokens(self, batch: Batch) -> int:
        """The token count of the graph this prefill step would replay; 0: it runs eagerly."""
        if not self.graphs or not batch.is_prefill or batch.size > self.max_reqs:
            return 0
        if any(r.sampling_params.prompt_logprobs is not None for r in batch.reqs):
            return 0
        tokens = sum(r.extend_len for r in batch.reqs)
        return next((n for n in self.token_counts if n >= tokens), 0)

    def pad_batch(self, batch: Batch) -> None:
        """A prefill step that will replay a graph gets empty requests up to max_reqs and its token
        count set (prepare.py pads the tokens with the dummy row); one that runs eagerly, its token count
        padded to `rounded_tokens`' count."""
        padded = self.padded_tokens(batch)
        if padded:
            batch.padded_reqs = batch.reqs + [self.empty_req] * (self.max_reqs - batch.size)
            batch.padded_tokens = padded
        elif self.eager_round and batch.is_prefill and not batch.num_decode_rows:
            if all(r.sampling_params.prompt_logprobs is None for r in batch.reqs):
                batch.padded_tokens = rounded_tokens(sum(r.extend_len for r in batch.reqs), self.eager_round)

    def can_use(self, batch: Batch) -> bool:
        # an eager step's rounded count may equal a graph's: only a step padded to max_reqs requests replays
        return batch.is_prefill and batch.padded_size == self.max_reqs and batch.padded_tokens in self.graphs

    @torch.inference_mode()
    def capture(self, stream: torch.cuda.Stream | None, pool: Any = None) -> None:
        """Capture one graph per token count, largest first so the smaller ones reuse its memory;
        `pool` is the decode graphs' memory pool, shared (the graphs never run at the same time)."""
        if not self.enabled:
            return
        try:
            self.attn_backend.init_prefill_capture(self.max_reqs)
        except NotImplementedError as e:
            logger.info_rank0(f"prefill runs without CUDA graphs: {e}")
            self.enabled = False
            return
        start = time.perf_counter()
        n = self.max_tokens
        scratch = int(get_global_ctx().page_table[self.dummy_table_idx, 0].item())
        self.inputs = StaticInputs(n, scratch, self.device)
        self.last_indices = torch.zeros(self.max_reqs, dtype=torch.int64, device=self.device)
        with graph_stream(stream):
            for tokens in reversed(self.token_counts):
                batch = Batch(reqs=[self.empty_req] * self.max_reqs, phase="prefill")
                batch.padded_tokens = tokens
                self.inputs.bind(batch, tokens)
                batch.last_indices = self.last_indices
                self.attn_backend.prepare_for_prefill_capture(batch, tokens)
                graph, self.logits[tokens] = capture_forward(
                    self.forward, batch, pool, stream, self.short_products
                )
                pool = graph.pool()
                self.graphs[tokens] = graph
        synchronize(self.device)
        logger.info_rank0(
            f"captured {len(self.graphs)} {graph_kind(stream)} graphs for prefill steps of up to {n} tokens and "
            f"{self.max_reqs} requests in {time.perf_counter() - start:.1f} s"
        )

    def replay(self, batch: Batch) -> torch.Tensor:
        n = batch.padded_tokens
        self.inputs.load(batch, n)
        self.last_indices.copy_(batch.last_indices)
        self.attn_backend.prepare_for_prefill_replay(batch)
        self.graphs[n].replay()
        return self.logits[n]

    def destroy(self) -> None:
        self.graphs.clear()
        self.logits.clear()
