"""Device workers: computation off the event loop, one thread per JAX device.

Each worker runs jobs one at a time on its own thread (XLA keeps the device busy;
a second thread per device would only contend). The queue is bounded: a request
that would wait behind ``queue_size`` others is refused with 503 and
``Retry-After``; one that runs past its deadline is answered 504 (a job that has
not started by then is dropped).

A job still running at its deadline never holds its worker: XLA cannot interrupt an
executable, so the worker *abandons* the thread running it and starts another on the
same queue at once. The abandoned thread finishes that job on its own (its answer is
dropped) and then exits; ``stuck`` counts those still running, which ``/health``
reports and shutdown does not wait for.

Request batching: a job may carry a ``group`` (same prep, operator and signature).
When the worker takes such a job it also takes every queued job of the same group,
up to ``max_batch``, and hands them to the group's runner in one call
(``batching.Batcher.run_group`` merges them into one vmapped call where that keeps
the bits). A job only ever waits for company (``batch_wait``) when it was queued
behind other work: a lone request on an idle worker starts at once.

Handing a job to a thread and back costs ~0.1-0.5 ms, more than a warm small
gradient takes. So a job whose last run (same ``key``) took under ``inline_below``
seconds runs directly on the event loop when its worker is idle; everything else,
and every first run, goes to a device worker. (Compiling is not a worker's job:
``compiling`` does it on threads of its own before the run is queued here.)

Fairness: a long job (one that runs in chunks, see ``chunking``) is given its
worker's ``pause`` as its ``Job.pause``. Between two of its chunks the worker runs,
on the same thread (so nothing contends for the device), the short jobs queued
meanwhile, for up to as long as the chunk took: a small request waits for one chunk,
not for the whole computation, and the long one keeps at least half the worker while
short ones keep arriving. Long jobs queued behind it wait their turn.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dxcontract.errors import DeadlineExceededError, OverloadedError
from dxcontract.lru import LRU
from dxserve.core import threads
from dxserve.core.progress import Job
from dxserve.frameworks import get_framework

T = TypeVar("T")
log = logging.getLogger("dxserve.worker")
_NEVER = float("inf")  # the cost of a job never run

#: ``run_group(items) -> one result or exception per item``
RunGroup = Callable[[Sequence[Any]], list[Any]]


@dataclass(eq=False)
class _Job:
    run: Callable[[], Any] | None  # a job of its own, or None for a group member
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    group: Hashable | None = None
    item: Any = None
    run_group: RunGroup | None = None
    queued_behind: int = 0  # jobs ahead of it when it arrived
    expired: bool = field(default=False)  # set by the event loop at its deadline
    #: a chunked run's progress: it pauses between chunks for short jobs (None: short)
    progress: Job | None = None
    worker: DeviceWorker | None = None  # where it is queued: told when it overruns


class DeviceWorker:
    def __init__(
        self, device: Any, queue_size: int, timeout: float, pin: bool,
        max_batch: int = 1, batch_wait: float = 0.0, nice: int = 0,
    ) -> None:
        self.device = device
        self.nice = nice
        self.queue_size = queue_size
        self.timeout = timeout
        self.max_batch = max_batch
        self.batch_wait = batch_wait
        self._pin = pin  # only worth a context switch when there are several devices
        self._queue: deque[_Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self.pending = 0  # queued + running
        self.batches = 0  # groups of two or more run together
        self.jobs = 0  # requests run here
        self.interleaved = 0  # short jobs run between the chunks of a long one
        self._pausing = False  # running short jobs between chunks (worker thread only)
        self._resumed = 0.0  # when the long job's current chunk started
        self._running: list[_Job] = []  # what the serving thread computes now
        self.stuck = 0  # abandoned threads still computing a job past its deadline
        self.abandoned = 0  # threads abandoned so far
        self._start_thread()

    def _start_thread(self) -> None:
        """Start a new serving thread (the lock held, or before any job)."""
        n = self.abandoned
        name = f"dx-{self.device}" + (f"-{n}" if n else "")
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def overran(self, job: _Job) -> None:
        """``job`` passed its deadline (event loop): if it is running, abandon the thread
        running it and serve the queue from a new one."""
        with self._cond:
            if self._closing or job not in self._running:
                return
            self.pending -= len(self._running)  # answered 504 (or soon, by their timers)
            self._running = []
            self.stuck += 1
            self.abandoned += 1
            self._start_thread()
        log.warning(
            "a computation on %s ran past its deadline; its thread was abandoned and "
            "replaced (%d still computing)", self.device, self.stuck,
        )

    async def run(
        self, job: Callable[[], T], timeout: float | None = None, progress: Job | None = None
    ) -> T:
        """Run ``job()`` on this device's thread; raise 503/504 errors as documented.
        ``timeout``: seconds before 504 (default: the worker's ``timeout``).
        ``progress``: the ``Job`` of a run in chunks; short jobs run between them."""
        loop = asyncio.get_running_loop()
        found = _Job(job, loop, loop.create_future(), progress=progress, worker=self)
        return await self._submit(found, timeout)

    async def run_grouped(
        self, group: Hashable, item: Any, run_group: RunGroup, timeout: float | None = None
    ) -> Any:
        """Run ``item`` through ``run_group``, merged with queued items of ``group``.
        ``timeout``: seconds before 504 (default: the worker's ``timeout``)."""
        loop = asyncio.get_running_loop()
        job = _Job(None, loop, loop.create_future(), group, item, run_group, worker=self)
        return await self._submit(job, timeout)

    async def _submit(self, job: _Job, timeout: float | None = None) -> Any:
        with self._cond:
            if self.pending >= self.queue_size:
                raise OverloadedError(
                    f"{self.pending} requests are queued on {self.device}; retry shortly",
                    retry_after=1,
                )
            job.queued_behind = self.pending
            self.pending += 1
            self._queue.append(job)
            self._cond.notify()
        timeout = self.timeout if timeout is None else timeout
        timer = job.loop.call_later(timeout, _expire, job, timeout)
        try:
            return await job.future
        finally:
            timer.cancel()

    # --- the device thread ----------------------------------------------------
    def _serve(self) -> None:
        # Below the event loop, so /health and small requests are answered while this
        # thread (and the threads it starts) computes; see threads.py.
        threads.lower_priority_of_current_thread(self.nice)
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._queue and not self._closing and self._thread is me:
                    self._cond.wait()
                if not self._queue or self._thread is not me:
                    return
                jobs = [self._queue.popleft()]
                if jobs[0].group is not None and self.max_batch > 1:
                    self._gather(jobs)
            self._execute(jobs)
            # Their futures hold their results (and the jobs their inputs): not kept
            # alive while this thread waits for the next job.
            del jobs

    def _gather(self, jobs: list[_Job]) -> None:
        """Add queued jobs of ``jobs[0]``'s group (lock held); maybe wait for more."""
        deadline = time.monotonic() + self.batch_wait if jobs[0].queued_behind else 0.0
        while True:
            for other in [j for j in self._queue if j.group == jobs[0].group]:
                if len(jobs) == self.max_batch:
                    return
                self._queue.remove(other)
                jobs.append(other)
            left = deadline - time.monotonic()
            if len(jobs) == self.max_batch or left <= 0:
                return
            self._cond.wait(left)

    def _execute(self, jobs: list[_Job]) -> None:
        me = threading.current_thread()
        with self._cond:
            before = self._running
            self._running = before + jobs
        # after they are marked running: one expiring from now on abandons this thread
        live = [j for j in jobs if not j.expired]
        outcomes: list[tuple[bool, Any]] = []
        with get_framework().on_device(self.device) if self._pin else nullcontext():
            if len(live) == 1 and live[0].progress is not None and live[0].run is not None:
                progress = live[0].progress
                progress.pause, self._resumed = self.pause, time.monotonic()
                try:
                    outcomes = [_attempt(live[0].run)]
                finally:
                    progress.pause = None
            elif len(live) == 1 and live[0].run is not None:
                outcomes = [_attempt(live[0].run)]
            elif live:
                ok, results = _attempt(lambda: live[0].run_group([j.item for j in live]))
                if ok:
                    outcomes = [(not isinstance(r, BaseException), r) for r in results]
                else:
                    outcomes = [(False, results)] * len(live)
                if len(live) > 1:
                    self.batches += 1
        with self._cond:
            if self._thread is me:
                self.pending -= len(jobs)
                self._running = before
            elif not before:  # abandoned, and its outermost job is done: it exits
                self.stuck -= 1
            self.jobs += len(live)
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for job, outcome in zip(live, outcomes, strict=True):
            by_loop.setdefault(job.loop, []).append((job.future, *outcome))
        for loop, settled in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle, settled)
            except RuntimeError:  # that loop has closed: nobody is waiting any more
                pass

    def pause(self) -> None:
        """Between two chunks of the long job running here (this worker's thread): run
        the short jobs queued now, for up to as long as the chunk took (at least one)."""
        if self._pausing or self._thread is not threading.current_thread():
            return
        chunk = time.monotonic() - self._resumed
        until = time.monotonic() + chunk
        self._pausing = True
        try:
            while True:
                with self._cond:
                    jobs = self._take_short()
                if not jobs:
                    break
                self._execute(jobs)
                self.interleaved += len(jobs)
                if time.monotonic() >= until or self._thread is not threading.current_thread():
                    break
        finally:
            self._pausing = False
            self._resumed = time.monotonic()

    def _take_short(self) -> list[_Job]:
        """The first queued short job, with its group's queued company (lock held)."""
        for job in self._queue:
            if job.progress is None:
                self._queue.remove(job)
                jobs = [job]
                if job.group is not None and self.max_batch > 1:
                    for other in [j for j in self._queue if j.group == job.group]:
                        if len(jobs) == self.max_batch:
                            break
                        self._queue.remove(other)
                        jobs.append(other)
                return jobs
        return []

    def close(self, timeout: float = 5.0) -> None:
        """Finish what is queued, then stop the thread; waits at most ``timeout``
        seconds (the thread is a daemon: a computation that never ends is left)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout)


def _attempt(fn: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, fn()
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
        return False, exc


def _settle(settled: list[tuple[asyncio.Future, bool, Any]]) -> None:
    for future, ok, value in settled:
        if future.done():
            continue
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)


def _expire(job: _Job, timeout: float) -> None:
    job.expired = True
    if job.worker is not None:
        job.worker.overran(job)
    if not job.future.done():
        job.future.set_exception(
            DeadlineExceededError(
                f"the computation ran past its deadline ({timeout:.3g} s after it was queued)"
            )
        )


class Workers:
    """One ``DeviceWorker`` per JAX device; jobs go to the least-loaded one."""

    MAX_TRACKED = 4096

    def __init__(
        self, queue_size: int = 256, timeout: float = 300.0, inline_below: float = 0.001,
        max_batch: int = 1, batch_wait: float = 0.0, nice: int = 0,
    ) -> None:
        self.devices = get_framework().devices()  # the default framework's (JAX's)
        pin = len(self.devices) > 1
        self.workers = [
            DeviceWorker(d, queue_size, timeout, pin, max_batch, batch_wait, nice)
            for d in self.devices
        ]
        self.inline_below = inline_below
        self.batching = max_batch > 1
        self.pinned = pin
        self._cost: LRU[Hashable, float] = LRU(self.MAX_TRACKED)  # key -> seconds of its last run

    def pick(self, holds: Callable[[Any], bool] | None = None) -> DeviceWorker:
        """The least-loaded worker. With ``holds(device)`` (is the job's executable
        compiled there?), a worker whose device holds it wins unless another is less
        loaded; that device then compiles its own copy, once."""
        workers = self.workers
        least = workers[0] if len(workers) == 1 else min(workers, key=lambda w: w.pending)
        if holds is None or not self.pinned:
            return least
        holding = [w for w in self.workers if holds(w.device)]
        if not holding:
            return least
        best = min(holding, key=lambda w: w.pending)
        return best if best.pending <= least.pending else least

    def _cheap(self, key: Hashable, worker: DeviceWorker) -> bool:
        # With batching on, a busy worker is where a cheap job finds company; with several
        # devices, executables are bound to one, so the job must run on its device's thread.
        idle_enough = not self.batching or worker.pending == 0
        return not self.pinned and idle_enough and self._cost.peek(key, _NEVER) < self.inline_below

    def device_of(self, worker: DeviceWorker) -> Any:
        """The device ``worker``'s jobs run on as JAX's default device (None: unpinned)."""
        return worker.device if self.pinned else None

    async def run(
        self, job: Callable[[], T], key: Hashable | None = None, timeout: float | None = None,
        worker: DeviceWorker | None = None, progress: Job | None = None, inline: bool = True,
    ) -> T:
        """Run ``job()``; inline if ``key``'s last run was cheap, else on a device worker.
        ``timeout``: seconds before 504 (default: the workers' ``timeout``). ``worker``:
        the one to run on (default: the least loaded). ``progress``: the ``Job`` of a run
        in chunks, which lets short jobs run between its chunks (never inline).
        ``inline=False``: never on the event loop (a job that may not end)."""
        worker = worker or self.pick()
        if key is None:
            return await worker.run(job, timeout, progress)
        if inline and progress is None and self._cheap(key, worker):
            return self._timed(job, key)
        return await worker.run(lambda: self._timed(job, key), timeout, progress)

    async def run_grouped(
        self, group: Hashable, item: Any, run_group: RunGroup, key: Hashable,
        holds: Callable[[Any], bool] | None = None, worker: DeviceWorker | None = None,
        timeout: float | None = None, inline: bool = True,
    ) -> Any:
        """Run one item of ``group`` (see ``DeviceWorker.run_grouped``); inline when cheap
        (and ``inline``).

        ``holds(device)`` tells where the group's executable is compiled (see ``pick``);
        ``worker``: the one to run on instead. ``timeout``: seconds before 504.
        """
        worker = worker or self.pick(holds)
        if inline and self._cheap(key, worker):
            result = self._timed(lambda: run_group([item])[0], key)
            if isinstance(result, BaseException):
                raise result
            return result
        return await worker.run_grouped(
            group, item, lambda items: self._timed(lambda: run_group(items), key, len(items)),
            timeout,
        )

    def _timed(self, job: Callable[[], T], key: Hashable, count: int = 1) -> T:
        start = time.perf_counter()
        result = job()
        self._cost.put(key, (time.perf_counter() - start) / count)
        return result

    @property
    def pending(self) -> int:
        return sum(w.pending for w in self.workers)

    @property
    def stuck(self) -> int:
        """Abandoned threads still computing past their deadline (see the module)."""
        return sum(w.stuck for w in self.workers)

    def close(self, timeout: float = 5.0) -> None:
        """Stop every worker, waiting at most ``timeout`` seconds in all."""
        deadline = time.monotonic() + timeout
        for worker in self.workers:
            worker.close(max(0.0, deadline - time.monotonic()))

    @property
    def computing(self) -> int:
        """Threads still computing (after ``close``: those it did not wait for)."""
        return self.stuck + sum(w._thread.is_alive() for w in self.workers)
