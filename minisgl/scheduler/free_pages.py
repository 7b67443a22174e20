"""FreePages: the KV pages nobody holds, handed out lowest first, a run at a time.

Lowest first keeps the pages a batch writes close together in the pool whatever order they came back in
(a last-freed-first list scattered them, and a CPU decode step of 64 requests slowed by 10-20% from one
generate() to the next: docs/benchmarks.md, "Smoothed W8A8"). A min-heap gave that order one heappop a
page: with pages of one slot, on a pool of a million (an H200's), a 1,024-token prompt's pages took the
scheduler about 0.55 ms, a tenth of a graphed prefill step, and a decode step of 256 requests 0.5-0.7 ms
(docs/benchmarks.md, "Handing out KV pages"). Here one byte a page marks the free ones, and a step's pages
are found and cleared a run at a time at C speed (bytearray.find, slice assignment): the same pages in
the same order as the heap, page for page.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator


class FreePages:
    def __init__(self, num_pages: int) -> None:
        self._free = bytearray(b"\x01") * num_pages  # 1: free
        self._count = num_pages
        self._lowest = 0  # no page below this one is free

    def __len__(self) -> int:
        return self._count

    def take(self, n: int) -> list[int]:
        """The n lowest free pages, ascending; they are no longer free."""
        if n > self._count:
            raise ValueError(f"{n} pages asked for, {self._count} free")
        free, out, pos = self._free, [], self._lowest
        while len(out) < n:
            start = free.find(1, pos)
            # the run's end, looked for only as far as the pages still wanted (a free tail can be the
            # whole pool: a decode step's page each would scan all of it)
            want = min(start + n - len(out), len(free))
            end = free.find(0, start, want)
            if end < 0:
                end = want
            k = end - start
            free[start : start + k] = bytes(k)
            out.extend(range(start, start + k))
            pos = start + k
        self._lowest = pos
        self._count -= n
        return out

    def give(self, pages: Iterable[int]) -> None:
        """Pages back; a page that is free already is a bookkeeping bug, refused before anything changes."""
        pages = list(pages)
        free = self._free
        if any(free[p] for p in pages) or len(set(pages)) != len(pages):
            raise AssertionError("a KV page was freed twice")
        for p in pages:
            free[p] = 1
        if pages:
            self._lowest = min(self._lowest, min(pages))
        self._count += len(pages)

    def __iter__(self) -> Iterator[int]:
        """The free pages, ascending."""
        free, pos = self._free, self._lowest
        while (start := free.find(1, pos)) >= 0:
            end = free.find(0, start)
            if end < 0:
                end = len(free)
            yield from range(start, end)
            pos = end
