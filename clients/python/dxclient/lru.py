"""``LRU``: the one bounded, thread-safe, least-recently-used map of the project.

Every cache and memo in client and server is one of these, so each has a size
bound and the same eviction rule.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRU(Generic[K, V]):
    """At most ``maxsize`` entries; ``get`` refreshes an entry, ``put`` evicts the oldest.

    ``hits`` and ``misses`` count ``get`` calls (``peek`` counts nothing).
    """

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            try:
                value = self._items[key]
            except KeyError:
                self.misses += 1
                return default
            self._items.move_to_end(key)
            self.hits += 1
            return value

    def peek(self, key: K, default: V | None = None) -> V | None:
        """``get`` without refreshing or counting."""
        with self._lock:
            return self._items.get(key, default)

    def put(self, key: K, value: V) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.maxsize:
                self._items.popitem(last=False)

    def pop(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            return self._items.pop(key, default)

    def discard_where(self, predicate: Callable[[K, V], bool]) -> int:
        """Drop every entry for which ``predicate(key, value)`` holds; returns how many."""
        with self._lock:
            doomed = [k for k, v in self._items.items() if predicate(k, v)]
            for key in doomed:
                del self._items[key]
            return len(doomed)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        return iter(self.keys())
