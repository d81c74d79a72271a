"""Giving freed heap memory back to the operating system after large requests.

glibc's malloc keeps what a process frees: small blocks, and (once a large block has
been freed, its mmap threshold grows up to 32 MiB) blocks of megabytes, come from the
heaps of per-thread arenas. After a large request (a dense Hessian's result, the body
being decoded, the JSON text of the answer) the server kept tens to hundreds of
megabytes it no longer used. ``malloc_trim(0)`` hands the free pages of every arena back.

``Trimmer.released(nbytes)`` is told of buffers just given back (the in-flight budget
of large bodies and results, and the caches of preps evicting); once ``threshold``
bytes have been released since the last trim, it wakes a thread of its own that trims,
at most once per ``interval`` seconds. Small requests (not counted by the budget) never
cause a trim, and the event loop never waits on one. Where a cache evicted preps
(``released(..., evicted=True)``), that thread first runs ``clear`` (the server's:
``jax.clear_caches``): JAX keeps, per input shape a prep was made for, the small
executables of its eager operations and its traces (~6 MB per distinct sparsity
pattern size, measured), bounded only by the count of its LRUs. The preps' own
executables are compiled ahead of time and unaffected.

``malloc_trim`` returns free pages inside every arena and the top of the main heap,
not the top of the other threads' heaps: those shrink only when a free leaves more
than glibc's trim threshold there, which glibc raises as large blocks are freed (up to
64 MiB). A server that answers many large requests can pin it lower with glibc's
``GLIBC_TUNABLES`` (see the README). Elsewhere than glibc (musl, macOS) the trimmer
does nothing; an allocator that returns memory by itself (jemalloc or mimalloc through
``LD_PRELOAD``) is the alternative there.
"""

from __future__ import annotations

import ctypes
import logging
import platform
import sys
import threading
import time
from collections.abc import Callable

_log = logging.getLogger("dxserve.memory")

#: Seconds between two trims at most: a trim walks every arena's free blocks (a few ms
#: for a heap of a gigabyte), taking each arena's lock in turn.
TRIM_INTERVAL = 1.0
#: Seconds from a release to its trim, so the frees that follow it (the rest of the
#: request's objects) are in before the pages are handed back.
SETTLE = 0.05


def malloc_trim() -> Callable[[], int] | None:
    """glibc's ``malloc_trim(0)`` as a callable, or None where there is none."""
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return lambda: trim(0)


class Trimmer:
    """Trims the heap (``trim``, default ``malloc_trim``) once releases add up to
    ``threshold`` bytes; ``threshold`` 0, or no ``malloc_trim`` here: never."""

    def __init__(
        self, threshold: int, interval: float = TRIM_INTERVAL,
        trim: Callable[[], object] | None = None, clear: Callable[[], object] | None = None,
    ) -> None:
        self.threshold = threshold
        self.interval = interval
        self._clear = clear
        self._evicted = False  # a cache evicted since the last trim: ``clear`` first
        self._trim = (trim or malloc_trim()) if threshold > 0 else None
        self.trims = 0  # trims done
        self._released = 0  # bytes released since the last trim was asked for
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._trim is not None

    def released(self, nbytes: int, evicted: bool = False) -> None:
        """``nbytes`` of buffers were just freed (``evicted``: by a cache evicting preps):
        trim soon once ``threshold`` bytes were."""
        if self._trim is None:
            return
        if evicted:
            self._evicted = True
        # from the event loop and worker threads: a lost update only delays a trim
        self._released += nbytes
        if self._released < self.threshold:
            return
        self._released = 0
        if self._thread is None:
            self._start()
        self._wake.set()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout=5)

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(target=self._run, name="dxserve-trim", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        last = -float("inf")
        while True:
            self._wake.wait()
            if self._closed.wait(max(SETTLE, last + self.interval - time.monotonic())):
                return
            self._wake.clear()  # releases from here on ask for the next trim
            if not self._trim_now():
                return
            last = time.monotonic()

    def _trim_now(self) -> bool:
        assert self._trim is not None
        start = time.monotonic()
        try:
            if self._evicted and self._clear is not None:
                self._evicted = False
                self._clear()
            self._trim()
        except Exception as exc:  # noqa: BLE001 - never let a trim stop the server
            _log.warning("heap trim failed: %s", exc)
            return False
        self.trims += 1
        _log.debug("heap trimmed in %.1f ms", 1000 * (time.monotonic() - start))
        return True
