"""CacheManager: KV page allocation and release, and the scheduler's face of the prefix cache.

Every page is in exactly one place: the free list, the prefix cache, or private to one running
request (the pages of its row that the cache does not own). `check_integrity` asserts that.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from minisgl.core import Req
from minisgl.kvcache.base import BasePrefixCache, MatchResult, NaivePrefixCache
from minisgl.scheduler.free_pages import FreePages
from minisgl.utils.misc import align_up
from minisgl.utils.torch_utils import int_tensor, to_device_async


def create_prefix_cache(cache_type: str, page_size: int) -> BasePrefixCache:
    if cache_type == "naive":
        return NaivePrefixCache()
    if cache_type == "radix":
        from minisgl.kvcache.radix import RadixPrefixCache

        return RadixPrefixCache(page_size)
    raise ValueError(f"cache_type={cache_type!r} is unknown; use 'radix' or 'naive'")


@dataclass
class RowPages:
    """The KV pages of one table row, in position order; the first `shared` belong to the prefix cache."""

    pages: list[int] = field(default_factory=list)
    shared: int = 0


class CacheManager:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        page_table: torch.Tensor,
        cache_type: str,
        will_use: Callable[[int], None] | None = None,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.page_table = page_table
        self.device = page_table.device
        self.cache_type = cache_type
        self.prefix_cache = create_prefix_cache(cache_type, page_size)
        # lowest first, a run at a time (free_pages.py says why)
        self.free_pages = FreePages(num_pages)
        self.rows: dict[int, RowPages] = {}
        # the rows' private pages (not the prefix cache's), kept as they change: the server reports it every
        # step (`private_pages`), and summing the rows cost a step of 256 requests tens of microseconds
        self._private = 0
        self._lazy_depth = 0
        self._lazy_freed: list[int] = []
        self._offsets = torch.arange(page_size, dtype=torch.int32)
        # told each time a page above every page handed out so far is handed out (the pool maps ahead)
        self._will_use = will_use
        self._highest = -1
        # the prefix pages of the requests admitted this step, (rows, columns, pages) for the page table, written
        # together with the step's next write (flush_rows): a burst sharing a system prompt admits hundreds
        self._attached: tuple[list[int], list[int], list[int]] = ([], [], [])

    # ---- admission -------------------------------------------------------------------------
    @property
    def available_size(self) -> int:
        """Tokens of KV that could be handed out now: free pages plus what eviction could free."""
        return (len(self.free_pages) + self.prefix_cache.evictable_pages) * self.page_size

    def match_req(self, key: list[Any], computes_all: bool = False) -> MatchResult:
        """The cached prefix a new request starts from (`key`: its prompt's cache_key); `computes_all`: none,
        the whole prompt is computed."""
        if computes_all:
            return MatchResult(None, [], 0)
        # the last prompt token is always computed: its logits give the first output token
        return self.prefix_cache.match_prefix(key[:-1])

    def lock(self, handle: Any) -> None:
        self.prefix_cache.lock(handle)

    def unlock(self, handle: Any) -> None:
        self.prefix_cache.unlock(handle)

    def attach_prefix(self, table_idx: int, match: MatchResult) -> None:
        """A newly admitted request starts with the matched pages of the cache in its row; they reach the page
        table with the next write of it (`flush_rows` at the latest), in one copy with the other admissions'."""
        self.rows[table_idx] = RowPages(list(match.pages), len(match.pages))
        if match.pages:
            rows, cols, pages = self._attached
            rows += [table_idx] * len(match.pages)
            cols += range(len(match.pages))
            pages += match.pages

    def flush_rows(self) -> None:
        """Write the prefix pages attached since the last write to the page table (PrefillAdder.write_prompts,
        before the step's forward reads them)."""
        if self._attached[0]:
            self._write_rows([], [], [])

    # ---- allocation ------------------------------------------------------------------------
    def allocate_paged(self, reqs: list[Req], decode: bool = False) -> None:
        """Give every request pages for the positions it computes this step, [cached_len, device_len);
        `decode`: a decode step, which computes one position a request."""
        if decode:
            self._allocate_decode(reqs)
            return
        needs: list[tuple[int, RowPages, int]] = []  # (table row, its pages, how many more)
        rows_of, ps = self.rows, self.page_size
        # every request of every step passes here (a decode step of 256 spent half a millisecond of host time):
        # the page counts are written out rather than through div_ceil and the Req properties
        for req in reqs:
            row = rows_of[req.table_idx]
            have, last = len(row.pages), (req.device_len + ps - 1) // ps
            if last > have:
                assert (req.cached_len + ps - 1) // ps >= have, "pages are allocated in order"
                needs.append((req.table_idx, row, last - have))
        if not needs:
            return
        # one take for the whole step: the lowest pages, handed out in request order, as one take a request
        # would have handed them out
        pages = self._take_pages(sum(k for _, _, k in needs))
        self._private += len(pages)
        rows: list[int] = []
        cols: list[int] = []
        if len(pages) == len(needs):  # a page each (a decode step's usual case)
            for (idx, row, _), page in zip(needs, pages):
                rows.append(idx)
                cols.append(len(row.pages))
                row.pages.append(page)
        else:
            at = 0
            for idx, row, k in needs:
                have = len(row.pages)
                row.pages.extend(pages[at : at + k])
                rows += [idx] * k
                cols += range(have, have + k)
                at += k
        self._write_rows(rows, cols, pages)

    def _allocate_decode(self, reqs: list[Req]) -> None:
        # a request computes position cached_len and needs a page when that position starts one: with a slot
        # a page every request every step, so the general loop's checks are one list each here
        ps = self.page_size
        needing = reqs if ps == 1 else [r for r in reqs if r.cached_len % ps == 0]
        if needing:
            rows, cols, pages = self._take_decode_pages(needing)
            self._write_rows(rows, cols, pages)

    def allocate_decode_slots(self, reqs: list[Req]) -> list[int]:
        """With a slot a page: the slot of each request's one position this decode step, in request order,
        recorded as the row's next page but not written to the page table: the caller writes them there
        (`Engine.prepare_batch` does, from the copy that takes the step's other inputs to the device)."""
        assert self.page_size == 1, "a decode step's slots are its pages only with a slot a page"
        return self._take_decode_pages(reqs)[2]

    def _take_decode_pages(self, reqs: list[Req]) -> tuple[list[int], list[int], list[int]]:
        """A page for each request, for the page its position cached_len starts: (table rows, the page's
        index in each row, the pages)."""
        ps = self.page_size
        pages = self._take_pages(len(reqs))
        rows = [r.table_idx for r in reqs]
        cols = [r.cached_len for r in reqs] if ps == 1 else [r.cached_len // ps for r in reqs]
        rows_of = self.rows
        for j, (idx, col, page) in enumerate(zip(rows, cols, pages)):
            held = rows_of[idx].pages
            if len(held) != col:  # the page before this position is missing: KV would land nowhere
                self._private += j
                self._release(pages[j:])  # the pages no row took go back before the error
                raise RuntimeError(f"table row {idx} holds {len(held)} pages, page {col} asked for (a bug)")
            held.append(page)
        self._private += len(pages)
        return rows, cols, pages

    def _take_pages(self, n: int) -> list[int]:
        """The n lowest free pages, evicting from the prefix cache first if too few are free."""
        short = n - len(self.free_pages)
        if short > 0:
            self._release(self.prefix_cache.evict(max(short, self.num_pages // 64)))
        if n > len(self.free_pages):
            raise RuntimeError("KV pool exhausted: admission control let in more than fits (a bug)")
        pages = self.free_pages.take(n)
        if pages and pages[-1] > self._highest:  # ascending: the last is the highest
            self._highest = pages[-1]
            if self._will_use is not None:
                self._will_use(self._highest)
        return pages

    def _write_rows(self, rows: list[int], cols: list[int], pages: list[int]) -> None:
        """page_table[rows[j], cols[j]*page_size + o] = pages[j]*page_size + o: page j of the list is page
        cols[j] of table row rows[j]. The attached prefix pages not yet written go first, in the same copy."""
        if self._attached[0]:
            rows, cols, pages = self._attached[0] + rows, self._attached[1] + cols, self._attached[2] + pages
            self._attached = ([], [], [])
        ps = self.page_size
        if ps == 1:  # a slot a page: the lists are the indices (one tensor built, not three and a stack)
            host = int_tensor(rows + cols + pages).view(3, -1)
        else:
            row_t = torch.tensor(rows, dtype=torch.int64).repeat_interleave(ps)
            col_t = (torch.tensor(cols, dtype=torch.int64)[:, None] * ps + self._offsets).reshape(-1)
            slot_t = (torch.tensor(pages, dtype=torch.int64)[:, None] * ps + self._offsets).reshape(-1)
            host = torch.stack([row_t, col_t, slot_t])
        # one asynchronous copy: a decode step writes pages here every step, and a blocking copy would
        # stop the host until it lands
        packed = to_device_async(host, self.device)
        self.page_table[packed[0], packed[1]] = packed[2].to(torch.int32)

    # ---- release ---------------------------------------------------------------------------
    @contextmanager
    def lazy_free_region(self) -> Iterator[None]:
        """Pages freed inside go back to the free list together at the end."""
        self._lazy_depth += 1
        try:
            yield
        finally:
            self._lazy_depth -= 1
            if self._lazy_depth == 0 and self._lazy_freed:
                self._release(self._lazy_freed)
                self._lazy_freed.clear()

    def flush(self) -> int:
        """Empty the prefix cache of every page no request holds; the number of pages freed."""
        freed = self.prefix_cache.evict(self.prefix_cache.evictable_pages)
        self._free(freed)
        return len(freed)

    def _free(self, pages: list[int]) -> None:
        if self._lazy_depth:
            self._lazy_freed.extend(pages)
        else:
            self._release(pages)

    def _release(self, pages: list[int]) -> None:
        self.free_pages.give(pages)

    def cache_req(self, req: Req, finished: bool) -> None:
        """Hand the request's computed KV to the prefix cache; a finished request also gives up its row."""
        row = self.rows[req.table_idx]
        if self.cache_type != "naive":
            self._insert(req, row)
        if finished:
            self.unlock(req.cache_handle)
            req.cache_handle = None
            self._drop_private(row)
            del self.rows[req.table_idx]

    def _insert(self, req: Req, row: RowPages) -> None:
        # KV is valid for every known token but the last received one, which no step has consumed yet
        kv_len = min(len(req.input_ids) - 1, req.cached_len)
        num = kv_len // self.page_size
        if num <= row.shared:
            return
        tokens = cache_key(req.input_ids[: num * self.page_size], req.cache_salt)
        known = self.prefix_cache.insert_prefix(tokens, row.pages[:num]) // self.page_size
        # pages of ours the cache already had from another request: use its copy, free ours
        duplicates = row.pages[row.shared : known]
        match = self.prefix_cache.match_prefix(tokens)
        assert match.length == num * self.page_size, "an inserted prefix must match whole"
        self.lock(match.handle)
        self.unlock(req.cache_handle)
        req.cache_handle = match.handle
        if duplicates:
            n = known - row.shared
            self._write_rows(
                [req.table_idx] * n, list(range(row.shared, known)), match.pages[row.shared : known]
            )
            self._free(duplicates)
        row.pages[:num] = match.pages
        self._private -= num - row.shared  # ours inserted, or freed for the cache's copies
        row.shared = num

    def free_req(self, req: Req) -> None:
        """An aborted request gives everything back, computed KV included (nothing is cached)."""
        row = self.rows.pop(req.table_idx, None)
        self.unlock(req.cache_handle)
        req.cache_handle = None
        if row is not None:
            self._drop_private(row)

    def _drop_private(self, row: RowPages) -> None:
        """A row's private pages go back (the row is being given up)."""
        self._private -= len(row.pages) - row.shared
        self._free(row.pages[row.shared :])

    # ---- accounting ------------------------------------------------------------------------
    def private_pages(self) -> int:
        return self._private

    def room_needed(self, table_idx: int, max_len: int) -> int:
        """Tokens of KV, in whole pages, that a row still has to take to hold max_len tokens."""
        return align_up(max_len, self.page_size) - len(self.rows[table_idx].pages) * self.page_size

    def check_integrity(self) -> None:
        """Every page is in exactly one place; rows point at their pages; only running rows hold locks."""
        free = list(self.free_pages) + list(self._lazy_freed)
        cached = self.prefix_cache.cached_pages()
        held = [p for r in self.rows.values() for p in r.pages[r.shared :]]
        if len(held) != self._private:
            raise AssertionError(f"{len(held)} private pages held, {self._private} counted")
        if (
            len(free) + len(cached) + len(held) != self.num_pages
            or len(cached) != self.prefix_cache.total_pages
        ):
            raise AssertionError(
                f"KV page accounting broken: {len(free)} free + {len(cached)} cached + {len(held)} held "
                f"!= {self.num_pages}"
            )
        if set(free) | set(cached) | set(held) != set(range(self.num_pages)):
            raise AssertionError("a KV page is in two places at once, or lost")
        shared = {p for r in self.rows.values() for p in r.pages[: r.shared]}
        if not shared <= set(cached):
            raise AssertionError("a row shares a page the prefix cache does not hold")
        # a running row locks exactly its shared pages; any other locked page is a leaked lock
        locked = self.prefix_cache.total_pages - self.prefix_cache.evictable_pages
        if locked != len(shared):
            raise AssertionError(f"{locked} cached pages are locked but running rows share {len(shared)}")
        ps = self.page_size
        for idx, r in self.rows.items():
            first_slots = self.page_table[idx, : len(r.pages) * ps : ps].tolist()
            if first_slots != [p * ps for p in r.pages]:
                raise AssertionError(f"page table row {idx} does not point at the pages it holds")


def cache_key(input_ids: list[int], salt: str | None) -> list[Any]:
    """The tokens as the prefix cache keys them: as they are, or with a salt (vLLM's cache_salt) paired with the
    first, so that the prefix shares no page with another salt's or with the unsalted requests' (the tree
    compares keys item by item: a pair never equals a token id, nor a pair of another salt)."""
    if salt is None or not input_ids:
        return input_ids
    return [(salt, input_ids[0]), *input_ids[1:]]
