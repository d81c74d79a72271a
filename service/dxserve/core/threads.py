"""Thread priorities: keep the event loop answering while long computations run.

On a small machine a long computation keeps every core busy: XLA compiles on its
own thread pool and runs programs on another, and the device worker thread traces
in Python. The event loop thread then waits for a core each time a request
arrives, which is what pushes ``/health`` past 10 ms (bench/health_latency.py).

Linux gives every thread its own nice value, and a new thread starts with its
creator's. So dxserve leaves the event loop at the process's priority and puts
everything that computes ``compute_nice`` steps lower:

- :func:`start_backend_at_low_priority` initialises JAX's backends on a helper
  thread whose priority is lowered first, so the thread pools XLA creates then
  (and the threads those pools start later, e.g. for compiling) inherit it;
- :func:`lower_priority_of_current_thread`, called by each device worker thread as
  it starts, covers the tracing it does and the threads it starts (LLVM's).

A lower priority only matters while another thread of the process wants the same
core: the event loop needs well under a millisecond per small request, so long
jobs keep the cores and are not measurably slower. With the kernel's autogroups
(one per session) nice values order threads within the server only. Elsewhere
than Linux (where the call would renice the whole process) both are no-ops.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

#: Nice steps between the event loop and the compute threads (Settings.compute_nice).
DEFAULT_STEPS = 10

_MAX_NICE = 19


def per_thread_priorities() -> bool:
    """Whether ``setpriority`` on a thread id changes that thread only (Linux)."""
    return sys.platform.startswith("linux") and hasattr(os, "setpriority")


def lower_priority_of_current_thread(steps: int = DEFAULT_STEPS) -> bool:
    """Set this OS thread's nice value ``steps`` above the process's (capped at 19).

    Idempotent (the target is relative to the process, i.e. the main thread, not to
    this thread), never raises the priority, and threads this one creates afterwards
    inherit the new value. Returns whether the thread now runs below the process.
    """
    if steps <= 0 or not per_thread_priorities():
        return False
    tid = threading.get_native_id()
    try:
        base = os.getpriority(os.PRIO_PROCESS, os.getpid())  # the main thread's value
        current = os.getpriority(os.PRIO_PROCESS, tid)
        target = min(_MAX_NICE, base + steps)
        if current < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        return os.getpriority(os.PRIO_PROCESS, tid) > base
    except OSError:  # pragma: no cover - a sandbox without setpriority
        return False


def start_backend_at_low_priority(
    steps: int = DEFAULT_STEPS, *, start: Callable[[], object]
) -> bool:
    """Initialise a framework's backends with ``start`` (JAX's: ``jax.devices``) on a
    lowered-priority helper thread.

    Call it before anything else touches the backend (for JAX: ``jax.devices()``, the
    first ``jnp`` array, the first compile): the backend's thread pools are created
    then, and only then can they inherit the lower priority. Once a backend exists this
    changes nothing. Returns whether the helper thread ran at the lower priority.
    """
    outcome: list[Any] = []

    def init() -> None:
        try:
            lowered = lower_priority_of_current_thread(steps)
            start()
            outcome.append(lowered)
        except BaseException as exc:  # re-raised on the caller's thread
            outcome.append(exc)

    helper = threading.Thread(target=init, name="dx-backend-init", daemon=True)
    helper.start()
    helper.join()
    if isinstance(outcome[0], BaseException):
        raise outcome[0]
    return bool(outcome[0])


def thread_priorities() -> dict[int, tuple[str, int]]:
    """``{native thread id: (name, nice)}`` for this process's threads (Linux; for
    tests and diagnosis)."""
    found: dict[int, tuple[str, int]] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # the thread has just exited
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        found[int(tid)] = (name, int(fields[16]))  # field 19 of stat: nice
    return found
