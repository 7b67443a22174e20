"""A registry by name: models by their Hugging Face architecture name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def wrap(item: T) -> T:
            if name in self._items:
                raise KeyError(f"{self.kind} {name!r} is registered twice")
            self._items[name] = item
            return item

        return wrap

    def get(self, name: str) -> T:
        if name not in self._items:
            known = ", ".join(sorted(self._items))
            raise ValueError(f"unknown {self.kind} {name!r}; known: {known}")
        return self._items[name]
