"""RadixPrefixCache on its own: whole-page matching, reference counts, LRU eviction, and a property test
against a plain model of the same behaviour (a dict from every cached page-aligned prefix to its page)."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from minisgl.kvcache.radix import RadixPrefixCache


def test_match_is_rounded_down_to_whole_pages():
    cache = RadixPrefixCache(page_size=4)
    assert cache.insert_prefix(list(range(8)), [10, 11]) == 0
    match = cache.match_prefix(list(range(7)))
    assert (match.length, match.pages) == (4, [10])
    assert cache.match_prefix([0, 1, 2]).handle is None


def test_insert_reports_the_tokens_already_cached_and_keeps_the_cached_pages():
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix([1, 2, 3, 4], [7, 8])
    # diverges inside the second page: the edge is split after the first page, never inside a page
    assert cache.insert_prefix([1, 2, 3, 9, 5, 6], [20, 21, 22]) == 2
    assert cache.match_prefix([1, 2, 3, 9, 5, 6, 0]).pages == [7, 21, 22]
    assert cache.match_prefix([1, 2, 3, 4, 0]).pages == [7, 8]
    assert cache.total_pages == 4


def test_locked_prefix_survives_eviction_and_unlock_makes_it_evictable():
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 2, 3], [0, 1, 2])
    cache.insert_prefix([1, 2, 4], [0, 1, 3])
    handle = cache.match_prefix([1, 2, 3]).handle
    cache.lock(handle)
    assert cache.evictable_pages == 1  # only [1, 2, 4]'s last page: the locked path covers 1, 2, 3
    assert sorted(cache.evict(10)) == [3]
    assert cache.match_prefix([1, 2, 3]).length == 3
    cache.unlock(handle)
    assert cache.evictable_pages == 3
    assert sorted(cache.evict(10)) == [0, 1, 2]
    assert cache.total_pages == 0


def test_lock_and_unlock_of_none_do_nothing():
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1], [0])
    cache.lock(None)
    cache.unlock(None)
    assert cache.evictable_pages == 1


def test_eviction_takes_the_least_recently_used_leaf_first():
    cache = RadixPrefixCache(page_size=1)
    cache.insert_prefix([1, 1], [0, 1])
    cache.insert_prefix([2, 2], [2, 3])
    cache.match_prefix([1, 1])  # [1, 1] is now newer than [2, 2]
    assert cache.evict(1) == [2, 3]
    assert cache.match_prefix([1, 1]).pages == [0, 1]


def test_a_split_edge_keeps_a_held_handle_on_its_whole_prefix():
    cache = RadixPrefixCache(page_size=2)
    cache.insert_prefix([1, 2, 3, 4, 5, 6], [0, 1, 2])
    handle = cache.match_prefix([1, 2, 3, 4, 5, 6]).handle
    cache.lock(handle)
    cache.insert_prefix([1, 2, 9, 9], [5, 6])  # splits the locked edge after its first page
    assert cache.evictable_pages == 1
    cache.unlock(handle)
    assert cache.evictable_pages == 4


class RadixAgainstModel(RuleBasedStateMachine):
    """Random insert / match+lock / unlock / evict sequences; after each, the tree and the model agree."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.cache = RadixPrefixCache(page_size)
        self.pages: dict[tuple[int, ...], int] = {}  # every cached page-aligned prefix -> its last page
        self.locks: Counter[tuple[int, ...]] = Counter()
        self.used: dict[tuple[int, ...], int] = {}  # prefix -> logical time of its last match or insert
        self.clock = 0
        self.held: list[tuple[object, tuple[int, ...]]] = []
        self.fresh = itertools.count()

    def _prefixes(self, tokens: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [tokens[:k] for k in range(self.ps, len(tokens) + 1, self.ps)]

    # tokens from a tiny alphabet, so prompts share prefixes and diverge inside pages often
    tokens = st.lists(st.integers(0, 2), max_size=12).map(tuple)

    @rule(tokens=tokens)
    def insert(self, tokens: tuple[int, ...]) -> None:
        tokens = tokens[: len(tokens) // self.ps * self.ps]
        pages = [next(self.fresh) for _ in range(len(tokens) // self.ps)]
        known = self.cache.insert_prefix(list(tokens), pages)
        self.clock += 1
        expected = 0
        for i, prefix in enumerate(self._prefixes(tokens)):
            if prefix in self.pages and expected == i * self.ps:
                expected += self.ps
            self.pages.setdefault(prefix, pages[i])
            self.used[prefix] = self.clock
        assert known == expected

    @rule(tokens=tokens, lock=st.booleans())
    def match(self, tokens: tuple[int, ...], lock: bool) -> None:
        result = self.cache.match_prefix(list(tokens))
        self.clock += 1
        matched = list(itertools.takewhile(lambda p: p in self.pages, self._prefixes(tokens)))
        for prefix in matched:
            self.used[prefix] = self.clock
        assert result.length == len(matched) * self.ps
        assert result.pages == [self.pages[p] for p in matched]
        assert (result.handle is None) == (not matched)
        if lock:
            self.cache.lock(result.handle)
            self.held.append((result.handle, tokens[: result.length]))
            self.locks.update(matched)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        handle, tokens = self.held.pop(data.draw(st.integers(0, len(self.held) - 1)))
        self.cache.unlock(handle)
        self.locks.subtract(self._prefixes(tokens))

    @rule(num_pages=st.integers(0, 8))
    def evict(self, num_pages: int) -> None:
        evictable = sum(1 for p in self.pages if self.locks[p] == 0)
        freed = self.cache.evict(num_pages)
        assert len(freed) >= min(num_pages, evictable)
        assert len(set(freed)) == len(freed)
        by_page = {page: prefix for prefix, page in self.pages.items()}
        gone = [by_page[page] for page in freed]
        assert all(self.locks[p] == 0 for p in gone), "a locked page was evicted"
        for prefix in gone:
            del self.pages[prefix]
        assert all(p[: -self.ps] in self.pages for p in self.pages if len(p) > self.ps), (
            "a page lost its parent"
        )
        leaves = [
            p for p in self.pages if self.locks[p] == 0 and not any(q[: len(p)] == p != q for q in self.pages)
        ]
        if gone and leaves:
            assert max(self.used[p] for p in gone) <= min(self.used[p] for p in leaves), (
                "not least recently used"
            )

    @invariant()
    def counts_agree(self) -> None:
        assert self.cache.total_pages == len(self.pages)
        assert sorted(self.cache.cached_pages()) == sorted(self.pages.values())
        assert self.cache.evictable_pages == sum(1 for p in self.pages if self.locks[p] == 0)


TestRadixAgainstModel = RadixAgainstModel.TestCase
TestRadixAgainstModel.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_salted_prefix_is_matched_only_under_its_salt(page_size: int) -> None:
    from minisgl.scheduler.cache import cache_key

    cache = RadixPrefixCache(page_size)
    ids = list(range(10, 26))
    cache.insert_prefix(cache_key(ids, "a"), list(range(len(ids) // page_size)))
    assert cache.match_prefix(cache_key(ids, "a")).length == 16
    assert cache.match_prefix(cache_key(ids, "b")).length == 0
    assert cache.match_prefix(ids).length == 0
    cache.insert_prefix(ids, list(range(100, 100 + len(ids) // page_size)))
    assert cache.match_prefix(ids).pages == list(range(100, 100 + len(ids) // page_size))
    assert cache.match_prefix(cache_key(ids, "a")).pages == list(range(len(ids) // page_size))
    assert cache_key(ids, None) is ids and cache_key([], "a") == []
