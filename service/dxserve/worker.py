"""Device workers: computation off the event loop, one thread per JAX device.

Each worker runs jobs one at a time on its own thread (XLA keeps the device
busy; a second thread per device would only contend). The queue is bounded:
a request that would wait behind ``queue_size`` others is refused with 503 and
``Retry-After``; one that runs past its deadline is answered 504 (the device
finishes the job in the background and the slot frees when it does).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import jax

from dxclient.errors import DeadlineExceededError, OverloadedError

T = TypeVar("T")


class DeviceWorker:
    def __init__(self, device: Any, queue_size: int, timeout: float) -> None:
        self.device = device
        self.queue_size = queue_size
        self.timeout = timeout
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
        future = self._pool.submit(self._run_on_device, job)
        future.add_done_callback(self._release)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout)
        except TimeoutError:
            raise DeadlineExceededError(
                f"the computation ran past the {self.timeout:g} s limit", field=None
            ) from None

    def _run_on_device(self, job: Callable[[], T]) -> T:
        with jax.default_device(self.device):
            return job()

    def _release(self, _future: Any) -> None:
        with self._lock:
            self.pending -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)


class Workers:
    """One ``DeviceWorker`` per JAX device; jobs go to the least-loaded one."""

    def __init__(self, queue_size: int = 256, timeout: float = 300.0) -> None:
        self.devices = jax.devices()
        self.workers = [DeviceWorker(d, queue_size, timeout) for d in self.devices]

    def pick(self) -> DeviceWorker:
        return min(self.workers, key=lambda w: w.pending)

    async def run(self, job: Callable[[], T]) -> T:
        return await self.pick().run(job)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()
