"""Progress: reports and cancellation between the chunks of a long computation.

A ``Job`` travels with one request from the transport down to the device worker.
Chunked operators (see ``chunking``) call ``report(done, total, unit)`` after each
chunk and ``check()`` before each one; ``check`` raises ``JobCancelled`` once
``cancel()`` was called (the client went away, or the request ran out of time), so
the worker stops at the next chunk boundary and moves on to the next job.

The worker thread reports; the event loop listens. ``listen(loop, callback)``
makes every report (and the start of a chunked run) call ``callback()`` on that loop,
thread-safely; a plain request that never listens pays for none of it.

A detached job (``detached``) also gives its ``Job`` ``checkpoints``: a chunked run
keeps each finished chunk there and takes the chunks kept by an earlier, interrupted
run of the same job instead of computing them again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

#: What ``done`` and ``total`` count, per chunked operator.
UNITS = ("columns", "rows", "points", "tangents")


class JobCancelled(Exception):  # noqa: N818 - a state, not a failure
    """The job was cancelled (client gone, or deadline passed): nobody wants its answer."""


class Checkpoints(Protocol):
    """Where a chunked run keeps its finished chunks (worker thread).

    ``key`` names one chunk of one plan (operator, unit, chunk size, dtype and start),
    so a chunk is only ever taken back into the run that would compute it bit for bit.
    """

    def restore(self, key: str, shape: tuple, dtype: Any) -> Any:
        """The chunk kept under ``key`` (an array of ``shape`` and ``dtype``), or None."""

    def save(self, key: str, block: Any, done: int) -> None:
        """Keep ``block`` under ``key``; ``done`` of the run's total are computed now.
        May raise ``JobCancelled`` (the job is no longer this process's to run)."""


class Job:
    """Progress and cancellation of one request's computation (see the module)."""

    __slots__ = (
        "done", "total", "unit", "cancelled", "streams", "chunked", "reports", "pause",
        "checkpoints", "_loop", "_notify",
    )

    def __init__(self, streams: bool = False) -> None:
        #: chunks done, all chunks, and what they count (None until a chunked run starts)
        self.done = 0
        self.total: int | None = None
        self.unit: str | None = None
        self.cancelled = False
        #: True when the caller watches progress (a stream): never merged into a batch
        self.streams = streams
        #: True once the computation runs in chunks (only then can it stop early)
        self.chunked = False
        #: every ``done`` reported, in order (a stream sends each chunk boundary)
        self.reports: list[int] = []
        #: set by the device worker running it: lets short jobs run between chunks
        self.pause: Callable[[], None] | None = None
        #: where finished chunks are kept across runs (a detached job), else None
        self.checkpoints: Checkpoints | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._notify: Callable[[], None] | None = None

    def listen(self, loop: asyncio.AbstractEventLoop, notify: Callable[[], None]) -> None:
        """Call ``notify()`` on ``loop`` when the run turns chunked and after each report."""
        self._loop, self._notify = loop, notify

    def start(self, total: int, unit: str) -> None:
        """The computation runs in chunks over ``total`` ``unit``s (worker thread)."""
        self.total, self.unit, self.done, self.chunked = total, unit, 0, True
        self.reports.append(0)
        self._wake()

    def report(self, done: int) -> None:
        """``done`` of ``total`` are computed (worker thread); before the next chunk,
        the worker may run short jobs that are waiting (``pause``)."""
        self.tell(done)
        self.between(done)

    def tell(self, done: int) -> None:
        """Tell listeners that ``done`` of ``total`` are computed (any thread)."""
        self.done = done
        self.reports.append(done)
        self._wake()

    def between(self, done: int) -> None:
        """Between two chunks (worker thread): run the short jobs that are waiting."""
        pause = self.pause
        if pause is not None and self.total is not None and done < self.total:
            pause()

    def check(self) -> None:
        """Raise ``JobCancelled`` if the job was cancelled (worker thread, between chunks)."""
        if self.cancelled:
            raise JobCancelled("cancelled")

    def cancel(self) -> None:
        """Stop at the next chunk boundary (any thread)."""
        self.cancelled = True

    def _wake(self) -> None:
        loop, notify = self._loop, self._notify
        if loop is None or notify is None:
            return
        try:
            loop.call_soon_threadsafe(notify)
        except RuntimeError:  # the loop has closed: nobody is listening any more
            pass
