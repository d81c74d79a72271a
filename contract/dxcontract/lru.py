"""``LRU``: the one bounded, thread-safe, least-recently-used map of the project.

Every cache and memo in client and server is one of these, so each has a size
bound and the same eviction rule. A cache whose entries differ widely in size (a
compiled operator, a sparsity pattern) bounds their bytes too: ``max_bytes`` with a
``sizeof`` that says what one entry holds.
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

    With ``max_bytes`` (and ``sizeof(value) -> bytes``), the entries' sizes sum to at
    most ``max_bytes`` as well: ``put`` evicts the least recently used until both bounds
    hold, and a value larger than ``max_bytes`` alone is not kept (``put`` returns
    False; the caller still has it). Sizes are measured at ``put`` and again by
    ``remeasure`` (for values that grow after they were put); ``nbytes`` is their sum.
    ``on_evict(key, value, size)`` is told of every entry evicted to make room (not of
    those dropped by ``pop``, ``discard_where`` or ``clear``), outside the lock.

    ``hits`` and ``misses`` count ``get`` calls (``peek`` counts nothing).
    """

    def __init__(
        self, maxsize: int, max_bytes: int | None = None,
        sizeof: Callable[[V], int] | None = None,
        on_evict: Callable[[K, V, int], None] | None = None,
    ) -> None:
        if max_bytes is not None and sizeof is None:
            raise ValueError("max_bytes needs sizeof")
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._sizeof = sizeof
        self._on_evict = on_evict
        self._items: OrderedDict[K, V] = OrderedDict()
        self._sizes: dict[K, int] = {}
        self._lock = threading.Lock()
        self.nbytes = 0
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

    def put(self, key: K, value: V) -> bool:
        """Keep ``value`` under ``key`` (the most recently used); False when it alone is
        larger than ``max_bytes`` (then not kept, and an older value of ``key`` dropped)."""
        if self._sizeof is None:  # a count bound only: the path of per-request memos
            with self._lock:
                self._items[key] = value
                self._items.move_to_end(key)
                evicted = self._evict() if len(self._items) > self.maxsize else []
            if evicted:
                self._tell(evicted)
            return True
        size = self._measure(value)  # outside the lock: sizeof may take a while
        with self._lock:
            self._drop(key)
            if self.max_bytes is not None and size > self.max_bytes:
                return False
            self._items[key] = value
            self._sizes[key] = size
            self.nbytes += size
            evicted = self._evict()
        self._tell(evicted)
        return True

    def remeasure(self, where: Callable[[K, V], bool] | None = None) -> int:
        """Measure again the entries for which ``where(key, value)`` holds (all without
        it), then evict to the bounds; returns the bytes held after."""
        with self._lock:
            items = [(k, v) for k, v in self._items.items() if where is None or where(k, v)]
        sizes = [(k, v, self._measure(v)) for k, v in items]
        with self._lock:
            for key, value, size in sizes:
                if self._items.get(key) is value:  # not replaced meanwhile
                    self.nbytes += size - self._sizes.get(key, 0)
                    self._sizes[key] = size
            evicted = self._evict()
        self._tell(evicted)
        return self.nbytes

    def size_of(self, key: K) -> int | None:
        """The bytes ``key``'s entry was last measured at (None: absent)."""
        with self._lock:
            return self._sizes.get(key)

    def pop(self, key: K, default: V | None = None) -> V | None:
        with self._lock:
            value = self._items.get(key, default)
            self._drop(key)
            return value

    def discard_where(self, predicate: Callable[[K, V], bool]) -> int:
        """Drop every entry for which ``predicate(key, value)`` holds; returns how many."""
        with self._lock:
            doomed = [k for k, v in self._items.items() if predicate(k, v)]
            for key in doomed:
                self._drop(key)
            return len(doomed)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._sizes.clear()
            self.nbytes = 0

    def keys(self) -> list[K]:
        with self._lock:
            return list(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[K]:
        return iter(self.keys())

    # --- under the lock ----------------------------------------------------------------
    def _measure(self, value: V) -> int:
        return max(0, int(self._sizeof(value))) if self._sizeof is not None else 0

    def _drop(self, key: K) -> None:
        if self._items.pop(key, _ABSENT) is not _ABSENT:
            self.nbytes -= self._sizes.pop(key, 0)

    def _evict(self) -> list[tuple[K, V, int]]:
        evicted = []
        while len(self._items) > self.maxsize or (
            self.max_bytes is not None and self.nbytes > self.max_bytes
        ):
            key, value = self._items.popitem(last=False)
            size = self._sizes.pop(key, 0)
            self.nbytes -= size
            evicted.append((key, value, size))
        return evicted

    def _tell(self, evicted: list[tuple[K, V, int]]) -> None:
        if self._on_evict is not None:
            for key, value, size in evicted:
                self._on_evict(key, value, size)


_ABSENT = object()
