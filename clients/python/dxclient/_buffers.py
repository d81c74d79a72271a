"""The buffers the fast path reads large answers into, kept for reuse.

A fresh 8 MB ``bytearray`` costs its zeroing and a page fault per 4 KiB before the first
byte lands: about a tenth of a 10^6-value gradient's round trip on loopback. A kept buffer
is handed out again only when nothing outside the pool refers to it (the answer, its
``content`` and every array decoded from it are gone), so a loop of same-sized calls
reads each answer into the same memory and an answer a caller keeps is never written over.
"""

from __future__ import annotations

import sys
import sysconfig
import threading


def _scan(kept: list[bytearray], size: int, free: int) -> bytearray | None:
    """The first buffer of ``size`` bytes in ``kept`` that only ``kept`` refers to
    (``free``: its reference count then, as counted here)."""
    for buf in kept:
        if len(buf) == size and sys.getrefcount(buf) == free:
            return buf
    return None


def _free_refcount() -> int | None:
    """What ``_scan`` counts for a buffer that only its list holds, measured by ``_scan``
    itself; None where reference counts can't tell (not CPython, or free-threaded)."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    for count in range(1, 8):
        if _scan([bytearray(1)], 1, count) is not None:
            return count
    return None


_FREE = _free_refcount()


class AnswerBuffers:
    """Buffers from ``min_bytes`` on are kept, at most ``max_count`` of them and
    ``max_bytes`` in all (the oldest let go first); smaller and larger answers, and every
    answer where reference counts can't tell, get fresh memory."""

    def __init__(
        self, min_bytes: int = 128 * 1024, max_bytes: int = 64 * 2**20, max_count: int = 8
    ) -> None:
        self.min_bytes, self.max_bytes, self.max_count = min_bytes, max_bytes, max_count
        self._kept: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A ``bytearray`` of ``size`` bytes (its old contents, if reused: the caller
        fills all of it)."""
        if _FREE is None or not self.min_bytes <= size <= self.max_bytes:
            return bytearray(size)
        with self._lock:
            buf = _scan(self._kept, size, _FREE)
            if buf is not None:
                return buf
            buf = bytearray(size)
            self._kept.append(buf)
            held = sum(map(len, self._kept))
            while len(self._kept) > self.max_count or held > self.max_bytes:
                held -= len(self._kept.pop(0))
            return buf

    def clear(self) -> None:
        with self._lock:
            self._kept = []
