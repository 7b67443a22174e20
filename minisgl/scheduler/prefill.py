"""PrefillManager: the queue waiting for prefill (first come first served, or by priority), and PrefillAdder,
which admits from it."""

from __future__ import annotations

from array import array
from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl.core import Batch, ChunkedReq, Req
from minisgl.scheduler.cache import CacheManager, cache_key
from minisgl.scheduler.decode import DecodeManager
from minisgl.scheduler.table import TableManager
from minisgl.scheduler.utils import PendingReq
from minisgl.utils.misc import align_up
from minisgl.utils.torch_utils import to_device_async


class PromptHeads:
    """The prompts (cache keys) admitted to this prefill batch and the last, and for each head length asked about
    the set of their first tokens of that length: whether an admitted prompt starts with a given head is then a
    set lookup, where a walk over the batch made a burst of n prompts cost n^2 / 2 slices and compares."""

    def __init__(self, prompts: list[list[Any]]) -> None:
        self.prompts = list(prompts)
        self.heads: dict[int, set[tuple[Any, ...]]] = {}

    def add(self, key: list[Any]) -> None:
        self.prompts.append(key)
        for n, heads in self.heads.items():
            if len(key) >= n:
                heads.add(tuple(key[:n]))

    def starts_any(self, head: list[Any]) -> bool:
        n = len(head)
        heads = self.heads.get(n)
        if heads is None:
            heads = self.heads[n] = {tuple(p[:n]) for p in self.prompts if len(p) >= n}
        return tuple(head) in heads


@dataclass
class PrefillAdder:
    """Admits requests into one prefill batch within a token budget and the KV room left.

    Per request: match the cached prefix, check for a free table row and enough KV room
    (prompt + max_tokens beside what is already promised); then the admitted prompts go into the token pool
    together (write_prompts).
    """

    token_budget: int
    reserved_size: int
    cache_manager: CacheManager
    table_manager: TableManager
    in_batch_prefix_share: int  # see _waits_for_batch
    batch_prompts: PromptHeads = field(default_factory=lambda: PromptHeads([]))  # their cache keys
    admitted: list[list[Any]] = field(default_factory=list)  # this batch's cache keys
    # the admitted prompts' tokens (table row, ids), written into the token pool together by write_prompts
    prompts_to_write: list[tuple[int, list[int]]] = field(default_factory=list)

    def try_add_one(self, pending_req: PendingReq) -> Req | None:
        if self.token_budget <= 0:
            return None
        if pending_req.chunked_req is not None:
            return self._continue_chunk(pending_req)
        if self.table_manager.available_size == 0:
            return None
        cm = self.cache_manager
        # prompt logprobs need the logits of every prompt position: a cached prefix has none
        computes_all = pending_req.sampling_params.prompt_logprobs is not None
        key = cache_key(pending_req.input_ids, pending_req.cache_salt)
        match = cm.match_req(key, computes_all)
        # waiting for a shared prefix to be cached gains nothing to a request that does not use the cache
        if not computes_all and self._waits_for_batch(key, match.length):
            return None
        cm.lock(match.handle)  # locked first, so the room counted below excludes the matched pages
        # whole pages for prompt + max_tokens, as check_request counts them: a request it lets
        # through always fits once the pool has drained
        need = align_up(pending_req.input_len + pending_req.output_len, cm.page_size) - match.length
        if cm.available_size < self.reserved_size + need:
            cm.unlock(match.handle)
            return None
        table_idx = self.table_manager.allocate()
        cm.attach_prefix(table_idx, match)
        self.prompts_to_write.append((table_idx, pending_req.input_ids))
        self.reserved_size += need
        return self._make_req(pending_req, table_idx, match.length, match.handle, key)

    def write_prompts(self) -> None:
        """The admitted prompts into the token pool: one host tensor (ids, table rows, positions) and one copy
        for the batch, where a copy a prompt cost a pinned staging and a launch each (a burst admits hundreds);
        the admitted requests' cached prefix pages go to the page table together too."""
        self.cache_manager.flush_rows()
        if not self.prompts_to_write:
            return
        ids = array("q")
        for _, prompt in self.prompts_to_write:
            ids.extend(prompt)
        lens = torch.tensor([len(prompt) for _, prompt in self.prompts_to_write])
        rows = torch.repeat_interleave(torch.tensor([row for row, _ in self.prompts_to_write]), lens)
        cols = torch.arange(len(ids)) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
        packed = torch.stack([torch.frombuffer(ids, dtype=torch.int64), rows, cols])
        pool = self.table_manager.token_pool
        # through pinned memory: a pageable copy would make the host wait for the step in flight
        on_device = to_device_async(packed, pool.device)
        pool[on_device[1], on_device[2]] = on_device[0].to(pool.dtype)
        self.prompts_to_write.clear()

    def _continue_chunk(self, pending_req: PendingReq) -> Req:
        chunked = pending_req.chunked_req
        assert chunked is not None
        # its room was promised at admission; requests behind it must leave that room alone
        max_len = pending_req.input_len + pending_req.output_len
        self.reserved_size += self.cache_manager.room_needed(chunked.table_idx, max_len)
        key = cache_key(pending_req.input_ids, pending_req.cache_salt)
        return self._make_req(pending_req, chunked.table_idx, chunked.cached_len, chunked.cache_handle, key)

    def _waits_for_batch(self, input_ids: list[Any], cached_len: int) -> bool:
        """Whether the prompt (its cache key: a salt shares nothing with another) shares in_batch_prefix_share
        or more uncached tokens (whole pages, the last left out as in match_req) with one admitted to this batch
        or the last; a shorter overlap (a chat header) is not worth a step."""
        if self.in_batch_prefix_share == 0 or self.cache_manager.cache_type == "naive":
            return False
        head = input_ids[: align_up(cached_len + self.in_batch_prefix_share, self.cache_manager.page_size)]
        return len(head) < len(input_ids) and self.batch_prompts.starts_any(head)

    def _make_req(
        self, pending_req: PendingReq, table_idx: int, cached_len: int, handle: object, key: list[Any]
    ) -> Req:
        self.batch_prompts.add(key)
        self.admitted.append(key)
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
        req.cache_salt = pending_req.cache_salt
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
    in_batch_prefix_share: int
    pending_list: list[PendingReq] = field(default_factory=list)
    # the prompts of the last prefill batch: under overlap its KV may not be in the cache yet
    last_prompts: list[list[Any]] = field(default_factory=list)

    def add_one_req(self, pending_req: PendingReq) -> None:
        """Queue behind every request of its rank or lower (so equal ranks keep their arrival order), and
        behind the requests part-way through a chunked prefill, which hold rows and pages and go on first."""
        queue = self.pending_list
        if not queue or queue[-1].rank <= pending_req.rank:
            queue.append(pending_req)  # every request without priority scheduling (rank 0)
            return
        head = 0
        while head < len(queue) and queue[head].chunked_req is not None:
            head += 1
        queue.insert(bisect_right(queue, pending_req.rank, lo=head, key=_rank), pending_req)

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
            in_batch_prefix_share=self.in_batch_prefix_share,
            batch_prompts=PromptHeads(self.last_prompts),
        )
        reqs: list[Req] = []
        chunked_list: list[PendingReq] = []
        # in the queue's order: stop at the first that does not fit, so a large request is not passed over for
        # ever by the smaller ones behind it
        for pending_req in self.pending_list:
            req = adder.try_add_one(pending_req)
            if req is None:
                break
            pending_req.chunked_req = None
            if isinstance(req, ChunkedReq):
                pending_req.chunked_req = req
                chunked_list.append(pending_req)
            reqs.append(req)
        adder.write_prompts()
        self.last_prompts = adder.admitted
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


def _rank(pending_req: PendingReq) -> int:
    return pending_req.rank
