"""The prefix cache interface, and the naive cache that keeps nothing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any


@dataclass
class MatchResult:
    handle: Any  # what lock/unlock take; None when nothing matched
    pages: list[int]  # pages holding the matched prefix, in order
    length: int  # matched tokens: len(pages) * page_size


class BasePrefixCache(ABC):
    """Maps token prefixes (whole pages of them) to the KV pages that hold them.

    The cache owns the pages it holds. A locked page is in use by a running request and may not
    be evicted; unlocked pages can be evicted, least recently used first, to make room.
    """

    @abstractmethod
    def match_prefix(self, input_ids: list[int]) -> MatchResult:
        """The longest cached prefix of input_ids, in whole pages. The handle stays valid while locked."""

    @abstractmethod
    def lock(self, handle: Any) -> None:
        """Keep the matched prefix from eviction (lock(None) does nothing); each lock needs one unlock."""

    @abstractmethod
    def unlock(self, handle: Any) -> None: ...

    @abstractmethod
    def insert_prefix(self, input_ids: list[int], pages: list[int]) -> int:
        """Insert whole pages of tokens; returns how many leading tokens the cache already had
        (the caller still owns those pages of its own and must free them)."""

    @abstractmethod
    def evict(self, num_pages: int) -> list[int]:
        """Remove at least `num_pages` unlocked pages if it can; returns the freed pages."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int: ...

    @property
    @abstractmethod
    def total_pages(self) -> int: ...

    @abstractmethod
    def cached_pages(self) -> list[int]:
        """Every page the cache holds, for integrity checks."""


class NaivePrefixCache(BasePrefixCache):
    """No reuse: nothing is matched, nothing is kept."""

    def match_prefix(self, input_ids: list[int]) -> MatchResult:
        return MatchResult(None, [], 0)

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def insert_prefix(self, input_ids: list[int], pages: list[int]) -> int:
        raise NotImplementedError("the naive cache keeps nothing")

    def evict(self, num_pages: int) -> list[int]:
        return []

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def total_pages(self) -> int:
        return 0

    def cached_pages(self) -> list[int]:
        return []
