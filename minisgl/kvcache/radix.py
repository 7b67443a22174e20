"""RadixPrefixCache: a radix tree of token prefixes whose edges hold whole pages of KV.

Every edge is a run of whole pages (its token key is a multiple of page_size long), so a prefix
is shared page by page and a split always falls on a page boundary. A node's lock count is the
number of handles at or below it: locking a node locks its whole path, and only unlocked leaves
are evicted, least recently used first.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from minisgl.kvcache.base import BasePrefixCache, MatchResult


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...]  # the tokens on the edge from the parent: whole pages
    pages: list[int]  # one KV page per page_size tokens of key
    parent: RadixNode | None
    uid: int  # creation order; breaks LRU ties the same way every run
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict)  # by first page of key
    lock_ref: int = 0
    last_access: int = 0

    def __lt__(self, other: RadixNode) -> bool:
        return (self.last_access, self.uid) < (other.last_access, other.uid)


class RadixPrefixCache(BasePrefixCache):
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._uids = itertools.count()
        self.root = RadixNode((), [], None, next(self._uids))
        self._clock = 0  # a logical clock: the order of accesses is all LRU needs
        self._total_pages = 0
        self._evictable_pages = 0

    # ---- lookup ----------------------------------------------------------------------------
    def match_prefix(self, input_ids: list[int]) -> MatchResult:
        node, length = self._walk(input_ids, len(input_ids) // self.page_size * self.page_size)
        pages = self._path_pages(node)
        return MatchResult(None if node is self.root else node, pages, length)

    def _walk(self, input_ids: list[int], end: int) -> tuple[RadixNode, int]:
        """Follow input_ids[:end] (whole pages) down the tree as far as it matches; returns the last
        node and the matched length. A match that stops inside an edge splits it there, so the
        node returned covers exactly the matched prefix."""
        self._clock += 1
        ps = self.page_size
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(tuple(input_ids[pos : pos + ps]))
            if child is None:
                break
            n = self._common_len(child.key, input_ids, pos, end)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = self._clock
            node, pos = child, pos + n
        return node, pos

    def _common_len(self, key: tuple[int, ...], input_ids: list[int], start: int, end: int) -> int:
        """Tokens of key that input_ids[start:end] matches, rounded down to whole pages (at least one)."""
        n = min(len(key), end - start)
        if tuple(input_ids[start : start + n]) == key[:n]:
            return n
        i = self.page_size  # the first page matched already: it is the child's dict key
        while i < n and key[i] == input_ids[start + i]:
            i += 1
        return i // self.page_size * self.page_size

    def _split(self, child: RadixNode, n: int) -> RadixNode:
        """Cut child's edge after n tokens. The new upper node goes between child and its parent,
        so child (which handles may hold) still ends where it did."""
        parent = child.parent
        assert parent is not None
        ps = self.page_size
        upper = RadixNode(
            child.key[:n],
            child.pages[: n // ps],
            parent,
            next(self._uids),
            lock_ref=child.lock_ref,
            last_access=child.last_access,
        )
        child.key, child.pages, child.parent = child.key[n:], child.pages[n // ps :], upper
        upper.children[child.key[:ps]] = child
        parent.children[upper.key[:ps]] = upper
        return upper

    def _path_pages(self, node: RadixNode) -> list[int]:
        runs: list[list[int]] = []
        while node.parent is not None:
            runs.append(node.pages)
            node = node.parent
        return [p for run in reversed(runs) for p in run]

    # ---- reference counts ------------------------------------------------------------------
    def lock(self, handle: Any) -> None:
        node = handle
        while node is not None and node.parent is not None:
            if node.lock_ref == 0:
                self._evictable_pages -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, handle: Any) -> None:
        node = handle
        while node is not None and node.parent is not None:
            assert node.lock_ref > 0, "unlock without a matching lock"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable_pages += len(node.pages)
            node = node.parent

    # ---- insertion and eviction ------------------------------------------------------------
    def insert_prefix(self, input_ids: list[int], pages: list[int]) -> int:
        if len(input_ids) != len(pages) * self.page_size:
            raise ValueError(f"{len(input_ids)} tokens do not fill {len(pages)} pages of {self.page_size}")
        node, known = self._walk(input_ids, len(input_ids))
        if known < len(input_ids):
            leaf = RadixNode(
                tuple(input_ids[known:]),
                list(pages[known // self.page_size :]),
                node,
                next(self._uids),
                last_access=self._clock,
            )
            node.children[leaf.key[: self.page_size]] = leaf
            self._total_pages += len(leaf.pages)
            self._evictable_pages += len(leaf.pages)
        return known

    def evict(self, num_pages: int) -> list[int]:
        heap = [n for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[: self.page_size]]
            freed += leaf.pages
            self._total_pages -= len(leaf.pages)
            self._evictable_pages -= len(leaf.pages)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, parent)
        return freed

    def _nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ---- accounting ------------------------------------------------------------------------
    @property
    def evictable_pages(self) -> int:
        return self._evictable_pages

    @property
    def total_pages(self) -> int:
        return self._total_pages

    def cached_pages(self) -> list[int]:
        return [p for node in self._nodes() for p in node.pages]
