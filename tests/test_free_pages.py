"""The free-page set hands out exactly what a min-heap would, page for page, and refuses double frees."""

from __future__ import annotations

import heapq
import random

import pytest
import torch

from minisgl.core import Req, SamplingParams
from minisgl.kvcache.base import MatchResult
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.free_pages import FreePages


def test_takes_and_gives_in_the_order_of_a_min_heap() -> None:
    rng = random.Random(0)
    n = 500
    pages, heap = FreePages(n), list(range(n))
    held: list[int] = []
    for _ in range(2000):
        if held and (rng.random() < 0.45 or len(heap) == 0):
            back = rng.sample(held, rng.randint(1, min(len(held), 40)))
            for p in back:
                held.remove(p)
                heapq.heappush(heap, p)
            pages.give(back)
        else:
            k = rng.randint(0, min(len(heap), 60))
            want = [heapq.heappop(heap) for _ in range(k)]
            assert pages.take(k) == want
            held += want
        assert len(pages) == len(heap)
        assert list(pages) == sorted(heap)


def test_a_page_freed_twice_is_refused_and_changes_nothing() -> None:
    pages = FreePages(8)
    taken = pages.take(3)
    pages.give([taken[0]])
    with pytest.raises(AssertionError, match="freed twice"):
        pages.give([taken[1], taken[0]])
    with pytest.raises(AssertionError, match="freed twice"):
        pages.give([taken[2], taken[2]])
    assert len(pages) == 6 and list(pages) == [0, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="9 pages asked for, 6 free"):
        pages.take(9)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_long_prompt_gets_its_pages_in_one_run_and_the_table_points_at_them(page_size: int) -> None:
    table = torch.zeros(3, 64, dtype=torch.int32)
    cm = CacheManager(64 // page_size, page_size, table, "radix")
    reqs = []
    for idx, n in enumerate([10, 23]):
        req = Req(input_ids=list(range(n)), table_idx=idx, cached_len=0, output_len=1, uid=idx,
                  sampling_params=SamplingParams(max_tokens=1), cache_handle=None, seed=0)  # fmt: skip
        cm.attach_prefix(idx, MatchResult(None, [], 0))
        reqs.append(req)
    cm.allocate_paged(reqs)
    first = -(-10 // page_size)
    assert cm.rows[0].pages == list(range(first))
    assert cm.rows[1].pages == list(range(first, first + -(-23 // page_size)))
    for idx in range(len(reqs)):
        slots = [p * page_size + o for p in cm.rows[idx].pages for o in range(page_size)]
        assert table[idx, : len(slots)].tolist() == slots
    cm.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_decode_steps_get_the_pages_and_table_the_general_path_gives(page_size: int) -> None:
    def run(decode: bool) -> tuple[list[list[int]], torch.Tensor]:
        table = torch.zeros(4, 64, dtype=torch.int32)
        cm = CacheManager(64 // page_size * 3, page_size, table, "radix")
        reqs = []
        for idx, n in enumerate([5, 8, 13]):
            req = Req(input_ids=list(range(n)), table_idx=idx, cached_len=0, output_len=20, uid=idx,
                      sampling_params=SamplingParams(max_tokens=20), cache_handle=None, seed=0)  # fmt: skip
            cm.attach_prefix(idx, MatchResult(None, [], 0))
            reqs.append(req)
        cm.allocate_paged(reqs)
        for _ in range(11):  # decode steps: each request computes one position, cached_len
            for req in reqs:
                req.complete_one()
            cm.allocate_paged(reqs, decode=decode)
        cm.check_integrity()
        return [cm.rows[i].pages for i in range(3)], table

    pages, table = run(decode=True)
    general_pages, general_table = run(decode=False)
    assert pages == general_pages and torch.equal(table, general_table)
    # the longest request's 13 + 11 positions, page by page
    assert len(pages[2]) == -(-24 // page_size)


def test_a_decode_step_refuses_a_row_whose_pages_fall_behind() -> None:
    table = torch.zeros(2, 16, dtype=torch.int32)
    cm = CacheManager(16, 1, table, "radix")
    req = Req(input_ids=[1, 2, 3], table_idx=0, cached_len=0, output_len=4, uid=0,
              sampling_params=SamplingParams(max_tokens=4), cache_handle=None, seed=0)  # fmt: skip
    cm.attach_prefix(0, MatchResult(None, [], 0))
    cm.allocate_paged([req])
    req.complete_one()
    req.complete_one()  # a step skipped: position 4's page is asked for while the row holds 3
    free = len(cm.free_pages)
    with pytest.raises(RuntimeError, match="holds 3 pages, page 4 asked for"):
        cm.allocate_paged([req], decode=True)
    assert len(cm.free_pages) == free  # the page taken for it went back
    cm.check_integrity()


@pytest.mark.parametrize("page_size", [1, 4])
def test_attached_prefix_pages_reach_the_table_in_one_write_with_the_steps_others(
    page_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Admitted requests' cached prefix pages wait for the step's next page-table write (or flush_rows) and go
    in the same copy, before it, so that the table ends as one write a request would leave it."""
    table = torch.zeros(4, 64, dtype=torch.int32)
    cm = CacheManager(64 // page_size * 3, page_size, table, "radix")
    writes: list[int] = []
    write = cm._write_rows

    def counted(rows: list[int], cols: list[int], pages: list[int]) -> None:
        writes.append(len(rows))
        write(rows, cols, pages)

    monkeypatch.setattr(cm, "_write_rows", counted)
    prefix = cm.free_pages.take(2)  # as if the prefix cache held them
    for idx in range(3):
        cm.attach_prefix(idx, MatchResult(None, list(prefix), 2 * page_size))
    assert writes == [] and not table.any()  # nothing written yet
    cm.flush_rows()
    assert len(writes) == 1
    for idx in range(3):
        slots = [p * page_size + o for p in prefix for o in range(page_size)]
        assert table[idx, : len(slots)].tolist() == slots
    cm.flush_rows()  # nothing left to write
    assert len(writes) == 1
    # attached, then the step's own pages: one write for both
    req = Req(input_ids=list(range(3 * page_size)), table_idx=3, cached_len=2 * page_size, output_len=1, uid=3,
              sampling_params=SamplingParams(max_tokens=1), cache_handle=None, seed=0)  # fmt: skip
    cm.attach_prefix(3, MatchResult(None, list(prefix), 2 * page_size))
    cm.allocate_paged([req])
    assert len(writes) == 2
    slots = [p * page_size + o for p in cm.rows[3].pages for o in range(page_size)]
    assert cm.rows[3].pages[:2] == prefix and table[3, : len(slots)].tolist() == slots
