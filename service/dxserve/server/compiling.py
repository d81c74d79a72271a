"""Compilation off the device workers: a small bounded pool of compile threads.

A first call traces and compiles its operator (a sparse backend also detects its
pattern) before anything runs. Done on a device worker, that held the device, and
every request queued behind it, for as long as XLA took. Here it runs on a thread of
its own, and the device worker is given only compiled executables to run.

* **Deadlines.** A request waits for its compilation at most until its deadline (the
  same one that covers its queueing and its run), then gets its 504 at once. A
  thread cannot be stopped, so the compilation itself goes on to its end and its
  executable is kept for the next request; the request shape limits
  (``request_shapes``) bound how long that can take, and the pool bounds how many
  run at once.
* **Once per key.** Requests for the same compilation (``key``) that arrive while it
  is queued or running wait for that one instead of compiling again.
* **Bounded.** At most ``threads`` compile at once and ``queue_size`` wait; past
  that, 503 + ``Retry-After``. A queued compilation whose every requester has gone
  (deadline, disconnect) is dropped without running.
* **Fair.** One caller (``run``'s ``caller``: the client's address) may have at most
  ``per_caller`` compilations of its own waiting or running; past that, 429
  ``too-many-queued`` naming ``setting``: a flood of new shapes from one client fills
  its own share, not the queue every other client needs.

The threads run ``nice`` steps below the event loop, as the device workers do
(see ``threads``), so ``/health`` and warm requests are answered while XLA compiles.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dxcontract.errors import DeadlineExceededError, OverloadedError, TooManyQueuedError
from dxserve.core import threads

T = TypeVar("T")


@dataclass(eq=False)
class _Task:
    key: Hashable
    fn: Callable[[], Any]
    #: futures of the requests waiting for it, with their loops
    waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = field(default_factory=list)
    started: bool = False
    caller: str | None = None  # who queued it: counted against its share until it ends


class Compiler:
    """A pool of ``threads`` compile threads with a queue of ``queue_size`` (see module)."""

    def __init__(
        self, threads: int = 2, queue_size: int = 64, nice: int = 0,
        per_caller: int | None = None, what: str = "compilations",
        setting: str = "compile_queue_per_caller",
    ) -> None:
        self.queue_size = queue_size
        self.nice = nice
        self.per_caller, self.what, self.setting = per_caller, what, setting
        self._by_caller: dict[str, int] = {}  # caller -> its tasks waiting or running
        self._queue: deque[_Task] = deque()
        self._tasks: dict[Hashable, _Task] = {}  # queued or running, by key
        self._cond = threading.Condition()
        self._closing = False
        self.running = 0
        self.compiled = 0  # compilations finished (with a result or an error)
        self.abandoned = 0  # requests that stopped waiting at their deadline
        self._threads = [
            threading.Thread(target=self._serve, name=f"dx-compile-{i}", daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def pending(self) -> int:
        """Compilations queued or running."""
        return len(self._tasks)

    async def run(
        self, key: Hashable, fn: Callable[[], T], timeout: float, limit: float | None = None,
        caller: str | None = None,
    ) -> T:
        """``fn()`` on a compile thread, shared with requests of the same ``key`` in
        flight; ``DeadlineExceededError`` after ``timeout`` seconds (``fn`` goes on;
        ``limit``: the request's whole time limit, for the message), ``OverloadedError``
        when ``queue_size`` compilations wait already, ``TooManyQueuedError`` when
        ``caller`` has ``per_caller`` of its own waiting or running."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        with self._cond:
            task = self._tasks.get(key)
            if task is None:
                queued = len(self._queue)
                if queued >= self.queue_size:
                    raise OverloadedError(
                        f"{queued} compilations are waiting; retry shortly", retry_after=1
                    )
                mine = self._by_caller.get(caller, 0) if caller is not None else 0
                if self.per_caller is not None and mine >= self.per_caller:
                    raise TooManyQueuedError(
                        f"{mine} {self.what} of yours are waiting or running "
                        f"(DXSERVE_{self.setting.upper()}); retry when they are done",
                        limit=self.setting,
                    )
                task = self._tasks[key] = _Task(key, fn, caller=caller)
                if caller is not None:
                    self._by_caller[caller] = mine + 1
                self._queue.append(task)
                self._cond.notify()
            task.waiters.append((loop, future))
        timer = loop.call_later(max(0.0, timeout), _expire, future, limit or timeout)
        try:
            return await future
        except DeadlineExceededError:
            self.abandoned += 1
            raise
        finally:
            timer.cancel()
            self._leave(task, future)

    def _leave(self, task: _Task, future: asyncio.Future) -> None:
        with self._cond:
            task.waiters = [(lp, f) for lp, f in task.waiters if f is not future]
            if not task.waiters and not task.started and self._tasks.get(task.key) is task:
                self._queue.remove(task)  # nobody wants it any more: never run
                del self._tasks[task.key]
                self._uncount(task)

    # --- the compile threads ------------------------------------------------------
    def _serve(self) -> None:
        threads.lower_priority_of_current_thread(self.nice)
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                task = self._queue.popleft()
                task.started = True
                self.running += 1
            try:
                outcome = (True, task.fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting requests
                outcome = (False, exc)
            with self._cond:
                self.running -= 1
                self.compiled += 1
                self._uncount(task)
                if self._tasks.get(task.key) is task:
                    del self._tasks[task.key]
                waiters = list(task.waiters)
            for loop, future in waiters:
                try:
                    loop.call_soon_threadsafe(_settle, future, *outcome)
                except RuntimeError:  # that loop has closed: nobody is waiting any more
                    pass

    def _uncount(self, task: _Task) -> None:
        """``task`` ended or was dropped: off its caller's share (lock held)."""
        if task.caller is not None:
            left = self._by_caller.pop(task.caller, 1) - 1
            if left > 0:
                self._by_caller[task.caller] = left

    def close(self, timeout: float = 5.0) -> None:
        """Drop what is queued and stop the threads (a running compilation is given
        ``timeout`` seconds; its thread is a daemon)."""
        with self._cond:
            self._closing = True
            self._queue.clear()
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout)


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


def _expire(future: asyncio.Future, timeout: float) -> None:
    if not future.done():
        future.set_exception(DeadlineExceededError(
            f"the request ran past its {timeout:g} s limit while its operator was compiled "
            "(the compilation goes on, and its executable is kept for the next request)"
        ))
