"""PrefillManager: the first-come-first-served queue waiting for prefill, and PrefillAdder, which admits from it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from minisgl.core import Batch, ChunkedReq, Req
from minisgl.kvcache.radix import RadixPrefixCache
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.table import TableManager
from minisgl.scheduler.utils import PendingReq
from minisgl.utils.misc import align_up

# a request that shares at least this many uncached tokens with an earlier request of the same batch waits for
# that request's KV rather than computing the shared prefix twice; a shorter overlap (a chat header) is not worth a step
IN_BATCH_SHARE_MIN = 32


@dataclass
class PrefillAdder:
    """Admits requests into one prefill batch within a token budget and the KV room left.

    Per request: match the cached prefix, check for a free table row and enough KV room
    (prompt + max_tokens beside what is already promised), write the prompt into the token pool.
    """

    token_budget: int
    reserved_size: int
    cache_manager: CacheManager
    table_manager: TableManager
    # the prompts of this batch: a request sharing more with one of them than the cache holds waits a step,
    # then reads that prefix from the cache instead of computing it again (None: the cache keeps nothing)
    batch_prompts: RadixPrefixCache | None = field(init=False)

    def __post_init__(self) -> None:
        reuse = self.cache_manager.cache_type != "naive"
        self.batch_prompts = RadixPrefixCache(self.cache_manager.page_size) if reuse else None

    def try_add_one(self, pending_req: PendingReq) -> Req | None:
        if self.token_budget <= 0:
            return None
        if pending_req.chunked_req is not None:
            return self._continue_chunk(pending_req)
        if self.table_manager.available_size == 0:
            return None
        cm = self.cache_manager
        match = cm.match_req(pending_req.input_ids)
        if self._shares_with_batch(pending_req.input_ids) - match.length >= IN_BATCH_SHARE_MIN:
            return None
        cm.lock(match.handle)  # locked first, so the room counted below excludes the matched pages
        # whole pages for prompt + max_tokens, as Scheduler._check_user_msg counts them: a request it lets
        # through always fits once the pool has drained
        need = align_up(pending_req.input_len + pending_req.output_len, cm.page_size) - match.length
        if cm.available_size < self.reserved_size + need:
            cm.unlock(match.handle)
            return None
        table_idx = self.table_manager.allocate()
        cm.attach_prefix(table_idx, match)
        ids = torch.tensor(pending_req.input_ids, dtype=torch.int32)
        self.table_manager.token_pool[table_idx, : len(ids)] = ids.to(self.table_manager.token_pool.device)
        self.reserved_size += need
        return self._make_req(pending_req, table_idx, match.length, match.handle)

    def _continue_chunk(self, pending_req: PendingReq) -> Req:
        chunked = pending_req.chunked_req
        assert chunked is not None
        # its room was promised at admission; requests behind it must leave that room alone
        max_len = pending_req.input_len + pending_req.output_len
        self.reserved_size += self.cache_manager.room_needed(chunked.table_idx, max_len)
        return self._make_req(pending_req, chunked.table_idx, chunked.cached_len, chunked.cache_handle)

    def _shares_with_batch(self, input_ids: list[int]) -> int:
        """Leading tokens (whole pages, the last token left out as in match_req) shared with this batch's prompts."""
        return 0 if self.batch_prompts is None else self.batch_prompts.match_prefix(input_ids[:-1]).length

    def _make_req(self, pending_req: PendingReq, table_idx: int, cached_len: int, handle: object) -> Req:
        if self.batch_prompts is not None:
            aligned = pending_req.input_len // self.cache_manager.page_size
            # the pages are placeholders: only the token prefixes are looked up
            self.batch_prompts.insert_prefix(
                pending_req.input_ids[: aligned * self.cache_manager.page_size], [-1] * aligned
            )
        extend_len = pending_req.input_len - cached_len
        chunk = min(extend_len, self.token_budget)
        self.token_budget -= chunk
        cls = ChunkedReq if chunk < extend_len else Req
        req = cls(
            input_ids=list(pending_req.input_ids),
            table_idx=table_idx,
            cached_len=cached_len,
            output_len=pending_req.output_len,
            uid=pending_req.uid,
            sampling_params=pending_req.sampling_params,
            cache_handle=handle,
            seed=pending_req.seed,
        )
        if cls is ChunkedReq:
            req.device_len = cached_len + chunk
        if pending_req.chunked_req is None:
            req.num_cached_tokens = cached_len
        else:
            req.num_cached_tokens = pending_req.chunked_req.num_cached_tokens
        return req


@dataclass
class PrefillManager:
    cache_manager: CacheManager
    table_manager: TableManager
    decode_manager: DecodeManager
    pending_list: list[PendingReq] = field(default_factory=list)

    def add_one_req(self, pending_req: PendingReq) -> None:
        self.pending_list.append(pending_req)

    @property
    def runnable(self) -> bool:
        return len(self.pending_list) > 0

    def schedule_next_batch(self, prefill_budget: int) -> Batch | None:
        if not self.pending_list:
            return None
        adder = PrefillAdder(
            token_budget=prefill_budget,
            reserved_size=self.decode_manager.inflight_tokens,  # the space already promised to the decoding requests
            cache_manager=self.cache_manager,
            table_manager=self.table_manager,
        )
        reqs: list[Req] = []
        chunked_list: list[PendingReq] = []
        for pending_req in self.pending_list:  # first come first served: stop at the first that does not fit
            req = adder.try_add_one(pending_req)
            if req is None:
                break
            pending_req.chunked_req = None
            if isinstance(req, ChunkedReq):
                pending_req.chunked_req = req
                chunked_list.append(pending_req)
            reqs.append(req)
        if not reqs:
            return None
        # an unfinished chunked request goes to the head of the queue and continues first next step
        self.pending_list = chunked_list + self.pending_list[len(reqs) :]
        return Batch(reqs=reqs, phase="prefill")

    def abort_req(self, uid: int) -> PendingReq | None:
        for i, pending_req in enumerate(self.pending_list):
            if pending_req.uid == uid:
                return self.pending_list.pop(i)
        return None
