"""The records every part of minisgl shares: Req, Batch and the forward Context (and SamplingParams, from params.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from minisgl.params import InvalidParam, RequestError, SamplingParams

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.kvcache.mha_pool import MHAKVCache

FinishReason = Literal["stop", "length", "abort", "error"]
# SamplingParams and the request errors live in params.py, which needs no torch (the CLI's help is fast)
__all__ = ["Batch", "ChunkedReq", "Context", "InvalidParam", "Req", "RequestError", "SamplingParams"]


class Req:
    """One request on the scheduler side.

    Its tokens live in row `table_idx` of the token pool; `[cached_len, device_len)` are the
    positions this step computes, and `device_len` is where the next sample is written.
    """

    def __init__(
        self,
        *,
        input_ids: list[int],
        table_idx: int,
        cached_len: int,
        output_len: int,
        uid: int,
        sampling_params: SamplingParams,
        cache_handle: Any,
        seed: int,
    ) -> None:
        self.input_ids = input_ids  # every token the CPU knows: the prompt, then each received sample
        self.prompt_len = len(input_ids)
        self.table_idx = table_idx
        self.cached_len = cached_len
        self.device_len = len(input_ids)
        self.max_device_len = len(input_ids) + output_len
        self.uid = uid
        self.sampling_params = sampling_params
        self.cache_handle = cache_handle
        self.seed = seed
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served at admission
        self.cache_salt: str | None = None  # UserMsg.cache_salt: its prefix cache namespace

    @property
    def extend_len(self) -> int:
        return self.device_len - self.cached_len

    @property
    def remain_len(self) -> int:
        return self.max_device_len - self.device_len

    @property
    def can_decode(self) -> bool:
        return self.remain_len > 0

    @property
    def output_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    def complete_one(self) -> None:
        """After a forward step: this step's tokens now have KV, and one more token was sampled."""
        self.cached_len = self.device_len
        self.device_len += 1

    def append_host(self, token: int) -> None:
        self.input_ids.append(token)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(uid={self.uid}, table_idx={self.table_idx}, "
            f"cached_len={self.cached_len}, device_len={self.device_len}, max_device_len={self.max_device_len})"
        )


class ChunkedReq(Req):
    """A prompt too long for this step's budget: computes [cached_len, device_len) and samples nothing."""

    @property
    def can_decode(self) -> bool:
        return False

    def complete_one(self) -> None:
        self.cached_len = self.device_len


@dataclass
class Batch:
    reqs: list[Req]
    phase: Literal["prefill", "decode"]
    # filled in by Engine.prepare_batch before the forward pass
    input_ids: torch.Tensor = field(init=False)
    positions: torch.Tensor = field(init=False)
    out_loc: torch.Tensor = field(init=False)
    # in a prefill, the packed index of each request's last token
    last_indices: torch.Tensor = field(init=False)
    # in a prefill, the packed indices of the prompt positions whose logits a request asks for
    # (prompt_logprobs); their logits follow the last tokens' ones. None: no request asks
    prompt_logit_indices: torch.Tensor | None = field(init=False, default=None)
    attn_metadata: Any = field(init=False, default=None)
    # a decode step's inputs in one device tensor (engine/prepare.py's make_decode_inputs): a graph copies them in
    packed_inputs: torch.Tensor | None = field(init=False, default=None)
    # reqs plus dummy rows that pad a CUDA-graph batch
    padded_reqs: list[Req] = field(init=False)
    # a prefill's tokens padded to this many (0: not padded): for its CUDA graph, or rounded up when eager
    # (engine/prefill_graph.py)
    padded_tokens: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.padded_reqs = self.reqs

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def padded_size(self) -> int:
        return len(self.padded_reqs)

    @property
    def is_prefill(self) -> bool:
        return self.phase == "prefill"

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"

    @property
    def num_decode_rows(self) -> int:
        """A mixed step's decode rows (SchedulerConfig.enable_mixed_chunk): its last requests, each past its prompt
        and computing one token over the KV it has. 0 for a decode step, which is all decode rows."""
        if self.is_decode:
            return 0
        reqs, n = self.reqs, 0
        while n < len(reqs) and reqs[-1 - n].cached_len >= reqs[-1 - n].prompt_len:
            n += 1
        return n


@dataclass
class Context:
    """What a forward pass reads besides its inputs: the KV pool, the page table, the attention backend."""

    page_size: int
    kv_cache: MHAKVCache
    page_table: torch.Tensor
    attn_backend: BaseAttnBackend
    _batch: Batch | None = None

    @property
    def batch(self) -> Batch:
        assert self._batch is not None, "no batch is being forwarded"
        return self._batch

    @contextmanager
    def forward_batch(self, batch: Batch) -> Iterator[None]:
        assert self._batch is None, "forward passes do not nest"
        self._batch = batch
        try:
            yield
        finally:
            self._batch = None

    @contextmanager
    def replaying(self, batch: Batch) -> Iterator[None]:
        """Inside a step's forward, `batch` (a graph's captured one) stands for it: an emulated graph's
        replay runs the forward again on the captured batch (engine/graph.py)."""
        outer, self._batch = self._batch, batch
        try:
            yield
        finally:
            self._batch = outer


_GLOBAL_CTX: Context | None = None


def set_global_ctx(ctx: Context | None) -> None:
    global _GLOBAL_CTX
    _GLOBAL_CTX = ctx


def get_global_ctx() -> Context:
    assert _GLOBAL_CTX is not None, "the engine has not been built in this process"
    return _GLOBAL_CTX


def forwarding_prefill() -> bool:
    """Whether a prefill (or extend) batch is being forwarded now; False outside a forward pass."""
    ctx = _GLOBAL_CTX
    batch = ctx._batch if ctx is not None else None
    return batch is not None and batch.is_prefill
