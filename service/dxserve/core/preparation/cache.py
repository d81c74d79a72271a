"""The implicit cache of preps: an LRU bounded by count and by the bytes it keeps alive.

Without an explicit prep, ``call`` keeps compiled preps in ``CACHE``, keyed by
(function, operator, backend, signature).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from dxcontract.lru import LRU
from dxserve.core.preparation.prep import Prep
from dxserve.core.wrt import Dotted, Selected


class PrepCache:
    """Preps keyed by (function, operator, backend, signature): an LRU of at most
    ``maxsize`` preps and, with ``max_bytes``, at most that many bytes of them
    (``Prep.nbytes``, measured again whenever a prep compiles more). A prep larger than
    ``max_bytes`` alone serves the request that made it and is not kept.

    Beside the requested backend's key, a prep is indexed weakly under its concrete
    backend, so backends that resolve alike share one compiled executable for as long
    as a prep of theirs is cached (or held by a caller); each such twin is counted in
    full (its shared executables twice: the bound holds). ``on_evict(nbytes)`` is told
    of each prep evicted to make room.
    """

    def __init__(
        self,
        maxsize: int = 512,
        max_bytes: int | None = None,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.maxsize = maxsize
        self.max_bytes = max_bytes
        self._items: LRU[tuple, Prep] = LRU(
            maxsize,
            max_bytes,
            Prep.nbytes,
            None if on_evict is None else lambda _key, _prep, size: on_evict(size),
        )
        self._resolved: weakref.WeakValueDictionary[tuple, Prep] = weakref.WeakValueDictionary()

    @property
    def nbytes(self) -> int:
        """The bytes the cached preps keep alive, as last measured."""
        return self._items.nbytes

    @property
    def hits(self) -> int:
        return self._items.hits

    @property
    def misses(self) -> int:
        return self._items.misses

    def get(self, key: tuple) -> Prep | None:
        return self._items.get(key)

    def peek(self, key: tuple) -> Prep | None:
        """``get`` without counting a hit or a miss."""
        return self._items.peek(key)

    def put(self, key: tuple, prep: Prep) -> bool:
        """Keep ``prep`` under ``key``; False if it alone is over ``max_bytes`` (not kept)."""
        prep.on_grow = self._grew
        kept = self._items.put(key, prep)
        if kept:  # indexed for its twins, unless a live prep of that backend is already
            twin_key = (prep.function, prep.operator, prep.resolved, prep.signature)
            self._resolved.setdefault(twin_key, prep)
        return kept

    def get_resolved(self, key: tuple) -> Prep | None:
        return self._resolved.get(key)

    def put_resolved(self, key: tuple, prep: Prep) -> None:
        self._resolved[key] = prep

    def clear(self) -> None:
        self._items.clear()
        self._resolved.clear()

    def forget(self, function: Callable) -> None:
        """Drop the preps of ``function``, and of its ``wrt`` and cotangent wrappers."""
        self._items.discard_where(lambda key, _: made_for(key[0], function))
        for key in [k for k in list(self._resolved.keys()) if made_for(k[0], function)]:
            self._resolved.pop(key, None)

    def _grew(self, prep: Prep) -> None:
        # twins share their executables: each is measured again
        self._items.remeasure(lambda _, cached: cached.executables is prep.executables)

    def __len__(self) -> int:
        return len(self._items)


CACHE = PrepCache()


def made_for(f: Callable, function: Callable) -> bool:
    """Is ``f`` ``function``, or a ``Selected``/``Dotted`` wrapper of it?"""
    while f is not function and isinstance(f, Selected | Dotted):
        f = f.f
    return f is function
