"""Device workers: computation off the event loop, one thread per JAX device.

Each worker runs jobs one at a time on its own thread (XLA keeps the device
busy; a second thread per device would only contend). The queue is bounded:
a request that would wait behind ``queue_size`` others is refused with 503 and
``Retry-After``; one that runs past its deadline is answered 504 (the device
finishes the job in the background and the slot frees when it does).

Handing a job to a thread and back costs ~0.1-0.5 ms, more than a warm small
gradient takes. So a job whose last run (same ``key``) took under
``inline_below`` seconds runs directly on the event loop; everything else, and
every first run (which traces and compiles), goes to a device worker.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, TypeVar

import jax

from dxclient.errors import DeadlineExceededError, OverloadedError

T = TypeVar("T")


class DeviceWorker:
    def __init__(self, device: Any, queue_size: int, timeout: float, pin: bool) -> None:
        self.device = device
        self.queue_size = queue_size
        self.timeout = timeout
        self._pin = pin  # only worth a context switch when there are several devices
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"dx-{device}")
        self._lock = threading.Lock()
        self.pending = 0  # queued + running

    async def run(self, job: Callable[[], T]) -> T:
        """Run ``job()`` on this device's thread; raise 503/504 errors as documented."""
        with self._lock:
            if self.pending >= self.queue_size:
                raise OverloadedError(
                    f"{self.pending} requests are queued on {self.device}; retry shortly",
                    retry_after=1,
                )
            self.pending += 1
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def finish(future: Any) -> None:
            with self._lock:
                self.pending -= 1
            loop.call_soon_threadsafe(_transfer, future, done)

        self._pool.submit(self._on_device, job).add_done_callback(finish)
        timer = loop.call_later(self.timeout, _expire, done, self.timeout)
        try:
            return await done
        finally:
            timer.cancel()

    def _on_device(self, job: Callable[[], T]) -> T:
        with jax.default_device(self.device) if self._pin else nullcontext():
            return job()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)


def _transfer(source: Any, target: asyncio.Future) -> None:
    if target.done():
        return
    exc = source.exception()
    if exc is not None:
        target.set_exception(exc)
    else:
        target.set_result(source.result())


def _expire(target: asyncio.Future, timeout: float) -> None:
    if not target.done():
        target.set_exception(
            DeadlineExceededError(f"the computation ran past the {timeout:g} s limit")
        )


class Workers:
    """One ``DeviceWorker`` per JAX device; jobs go to the least-loaded one."""

    MAX_TRACKED = 4096

    def __init__(
        self, queue_size: int = 256, timeout: float = 300.0, inline_below: float = 0.001
    ) -> None:
        self.devices = jax.devices()
        pin = len(self.devices) > 1
        self.workers = [DeviceWorker(d, queue_size, timeout, pin) for d in self.devices]
        self.inline_below = inline_below
        self._cost: dict[Hashable, float] = {}  # key -> seconds of its last run

    def pick(self) -> DeviceWorker:
        return min(self.workers, key=lambda w: w.pending)

    async def run(self, job: Callable[[], T], key: Hashable | None = None) -> T:
        """Run ``job()``; inline if ``key``'s last run was cheap, else on a device worker."""
        if key is None:
            return await self.pick().run(job)
        if self._cost.get(key, float("inf")) < self.inline_below:
            return self._timed(job, key)
        return await self.pick().run(lambda: self._timed(job, key))

    def _timed(self, job: Callable[[], T], key: Hashable) -> T:
        start = time.perf_counter()
        result = job()
        if len(self._cost) >= self.MAX_TRACKED:
            self._cost.clear()
        self._cost[key] = time.perf_counter() - start
        return result

    @property
    def pending(self) -> int:
        return sum(w.pending for w in self.workers)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
