"""Job event streams that cost the same for 1 or 3,000 watchers.

``JobWatches`` keeps one ``Watch`` per job that someone follows: one task that reads
the job's record from the store every poll interval (or at once when this process
changes the job: ``notify``), shared by every stream following it. A watcher waits for
the watch's next version with ``Watch.wait``; the store sees one read per job per
interval, however many follow it, and no stream holds a thread.

Streams are capped per job (``DXSERVE_MAX_STREAMS_PER_JOB``) and per owner
(``DXSERVE_MAX_STREAMS_PER_OWNER``): past either, ``open`` raises
``TooManyStreamsError`` (429 with ``Retry-After``) before the stream starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from dxcontract.errors import TooManyStreamsError

log = logging.getLogger("dxserve.jobs")


class Watch:
    """One followed job: its latest record (None once removed) and a version that
    grows with each change seen."""

    __slots__ = ("_changed", "_poke", "_task", "job_id", "owner", "rec", "version", "watchers")

    def __init__(self, job_id: str, owner: str, rec: Any) -> None:
        self.job_id, self.owner, self.rec = job_id, owner, rec
        self.version = 0
        self.watchers = 0
        self._changed = asyncio.Event()
        self._poke = asyncio.Event()
        self._task: asyncio.Task | None = None

    def publish(self, rec: Any) -> None:
        """A new record (or a poke): every watcher waiting wakes."""
        self.rec = rec
        self.version += 1
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def wait(self, seen: int, timeout: float) -> bool:
        """Wait until the version passes ``seen`` (True) or ``timeout`` seconds pass."""
        if self.version > seen:
            return True
        changed = self._changed
        try:
            await asyncio.wait_for(changed.wait(), timeout)
        except TimeoutError:
            return self.version > seen
        return True


class JobWatches:
    """The watches of one process (see the module). ``read(job_id)``: the job's record
    from the store, run in a thread; ``interval``: seconds between reads."""

    def __init__(
        self, read: Callable[[str], Any], interval: float, per_job: int, per_owner: int
    ) -> None:
        self.read, self.interval = read, interval
        self.per_job, self.per_owner = per_job, per_owner
        self._watches: dict[str, Watch] = {}
        self._owners: dict[str, int] = {}
        #: store reads made by the watches (one per followed job per interval)
        self.reads = 0

    def open(self, rec: Any, owner: str) -> Watch:
        """A stream's share of ``rec``'s watch (made if none); 429 past a cap."""
        watch = self._watches.get(rec.id)
        if watch is not None and watch.watchers >= self.per_job:
            raise TooManyStreamsError(
                f"{watch.watchers} streams follow job {rec.id} already, the most one job may "
                f"have (DXSERVE_MAX_STREAMS_PER_JOB={self.per_job}); retry shortly, or poll "
                "GET /jobs/{id}",
                field="id",
                limit="max_streams_per_job",
                retry_after=5,
            )
        if self._owners.get(owner, 0) >= self.per_owner:
            raise TooManyStreamsError(
                f"you have {self._owners[owner]} job streams open, the most one owner may "
                f"(DXSERVE_MAX_STREAMS_PER_OWNER={self.per_owner}); close some, or retry "
                "shortly",
                field="id",
                limit="max_streams_per_owner",
                retry_after=5,
            )
        if watch is None:
            watch = self._watches[rec.id] = Watch(rec.id, owner, rec)
            watch._task = asyncio.get_running_loop().create_task(self._poll(watch))
        watch.watchers += 1
        self._owners[owner] = self._owners.get(owner, 0) + 1
        return watch

    def close(self, watch: Watch, owner: str) -> None:
        """A stream following ``watch`` has ended; the last one stops its polling."""
        watch.watchers -= 1
        left = self._owners.get(owner, 1) - 1
        if left:
            self._owners[owner] = left
        else:
            self._owners.pop(owner, None)
        if watch.watchers <= 0 and self._watches.get(watch.job_id) is watch:
            del self._watches[watch.job_id]
            if watch._task is not None:
                watch._task.cancel()

    def stop(self) -> None:
        """The server stops: no watch reads the store any more."""
        for watch in self._watches.values():
            if watch._task is not None:
                watch._task.cancel()

    def notify(self, job_id: str) -> None:
        """This process changed the job: its watch reads it now, not at the interval."""
        watch = self._watches.get(job_id)
        if watch is not None:
            watch._poke.set()

    def watched(self) -> int:
        """Jobs followed now."""
        return len(self._watches)

    def streams(self) -> int:
        """Streams open now."""
        return sum(self._owners.values())

    async def _poll(self, watch: Watch) -> None:
        while True:
            poked = False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(watch._poke.wait(), self.interval)
                poked = True
            watch._poke.clear()
            try:
                self.reads += 1
                fresh = await asyncio.to_thread(self.read, watch.job_id)
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the store busy: the next interval tries again
                log.warning(
                    "job %s: its watch could not read the store", watch.job_id, exc_info=True
                )
                continue
            if poked or fresh is None or _moved(watch.rec, fresh):
                watch.publish(fresh)
            if fresh is None or fresh.ended:
                # nothing more will change: the watchers finish with this record
                return


def _moved(old: Any, new: Any) -> bool:
    """Has the job changed in what a stream tells (status, progress)?"""
    if old is None:
        return True
    return (old.status, old.done, old.total, old.ended) != (
        new.status,
        new.done,
        new.total,
        new.ended,
    )
