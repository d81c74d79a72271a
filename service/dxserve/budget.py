"""Budgets: what one request may cost, known before it runs, and what all may hold at once.

Per request (``ComputeLimits``): XLA's own analysis of a compiled executable says how
much device memory it needs (arguments, outputs, temporaries, generated code) and how
much work it does (flops, transcendentals, bytes accessed). ``preparation`` reads it
once, when it compiles, and refuses with ``BudgetExceededError`` (422) an operator over
a bound, before it ever runs. XLA cannot interrupt a running executable, so this
refusal is the only bound on device time: an operator whose estimate at the assumed
(conservative) rates exceeds the request timeout is refused, not started.

XLA counts the body of a loop once; ``estimate`` multiplies by the largest trip count
the compiled program states (``known_trip_count``), and a loop whose count depends on
data is counted once. Functions JAX cannot trace (server-side numpy code) have no
analysis and are not bounded here: they are trusted code.

In total (``InFlight``): bytes held for requests being read and decoded and for results
until they are sent, and the number of large results being computed at once. Both are
plain counters: the byte budget is only touched from the event loop, and the large
result slots, which a worker thread may take, only by requests that are large anyway.
Small requests (bodies and results up to ``http.routes.LARGE_BYTES``) are not counted.
"""

from __future__ import annotations

import math
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dxclient.errors import BudgetExceededError, OverloadedError

#: How many bytes decoding one body byte may hold at the peak, per request media type:
#: JSON numbers become Python objects (~16x measured for float lists), a binary body is
#: read in chunks and joined once (2x), and arrays are then views into it.
DECODE_FACTOR = {"json": 16, "binary": 2}
#: Encoded bytes per result byte, beside the result itself: JSON text of float64 is up
#: to ~3x its binary size, base64 4/3, and the binary framing sends the arrays' memory.
ENCODE_FACTOR = {"json": 3, "b64": 2, "binary": 0}

#: Each byte an executable needs counts this many bytes of traffic in the time estimate:
#: fresh buffers are allocated, zeroed by the OS and first touched, which on CPU costs
#: far more per byte than re-reading data the caches hold (measured: an n⁴ gradient
#: with 1 GB of temporaries ran 5x longer than its traffic alone predicts).
ALLOCATION_WEIGHT = 10

_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


@dataclass(frozen=True, slots=True)
class Estimate:
    """What XLA's analysis says one executable costs."""

    memory_bytes: int  # arguments + outputs + temporaries + generated code
    flops: float  # flops and transcendentals, times the longest stated loop
    bytes_accessed: float  # memory traffic, times the longest stated loop
    loop_trips: int = 1  # the largest known trip count of a loop in the program


def estimate(executable: Any) -> Estimate | None:
    """``executable``'s memory and cost analysis, or None where XLA gives none."""
    try:
        memory = executable.memory_analysis()
        cost = executable.cost_analysis()
    except Exception:  # noqa: BLE001 - a backend without the analysis: nothing to bound
        return None
    if isinstance(cost, list | tuple):  # older JAX: one dict per computation
        cost = cost[0] if cost else None
    if memory is None and not cost:
        return None
    size = 0
    if memory is not None:
        size = sum(
            int(getattr(memory, name, 0) or 0)
            for name in (
                "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
                "generated_code_size_in_bytes", "host_argument_size_in_bytes",
                "host_output_size_in_bytes", "host_temp_size_in_bytes",
                "host_generated_code_size_in_bytes",
            )
        )
        # a donated argument and the output it becomes share one buffer
        size -= sum(
            int(getattr(memory, name, 0) or 0)
            for name in ("alias_size_in_bytes", "host_alias_size_in_bytes")
        )
    cost = cost or {}
    trips = _longest_loop(executable)
    flops = (_number(cost.get("flops")) + _number(cost.get("transcendentals"))) * trips
    return Estimate(size, flops, _number(cost.get("bytes accessed")) * trips, trips)


def _number(value: Any) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


def _longest_loop(executable: Any) -> int:
    """The largest ``known_trip_count`` in the compiled program (1 if none or unknown)."""
    try:
        text = executable.as_text()
    except Exception:  # noqa: BLE001 - no text: count loops once
        return 1
    if not text or "while" not in text:
        return 1
    return max((int(n) for n in _TRIP_COUNT.findall(text)), default=1)


@dataclass(frozen=True)
class ComputeLimits:
    """Per-request bounds checked against ``estimate`` at preparation (None: unbounded).

    ``max_seconds`` bounds the estimated run time: flops at ``flops_per_second`` plus
    memory traffic (bytes accessed, and ``ALLOCATION_WEIGHT`` times the bytes the
    executable needs) at ``bytes_per_second``, rates chosen low enough that a real run
    is faster (so an operator estimated to fit does finish within the request timeout).
    """

    max_memory_bytes: int | None = None
    max_flops: float | None = None
    max_seconds: float | None = None
    flops_per_second: float = 1e10
    bytes_per_second: float = 1e10
    #: bytes one chunk of a chunked Jacobian or Hessian may need (None: the default of
    #: ``chunking.DEFAULT_CHUNK_MEMORY_BYTES``)
    chunk_memory_bytes: int | None = None
    #: basis vectors (or batch items) from which a chunkable operator runs in chunks
    #: even when it fits (None: ``chunking.CHUNK_FROM``; 0: only past the budget)
    chunk_from: int | None = None

    def seconds(self, est: Estimate) -> float:
        traffic = est.bytes_accessed + ALLOCATION_WEIGHT * est.memory_bytes
        return est.flops / self.flops_per_second + traffic / self.bytes_per_second

    def check(self, executable: Any, what: str) -> Estimate | None:
        """Raise ``BudgetExceededError`` if ``executable`` is over a bound; its estimate."""
        est = estimate(executable)
        if est is None:
            return None
        if self.max_memory_bytes is not None and est.memory_bytes > self.max_memory_bytes:
            raise BudgetExceededError(
                f"{what} needs an estimated {est.memory_bytes:,} bytes of device memory, "
                f"over the limit of {self.max_memory_bytes:,} (DXSERVE_MAX_REQUEST_MEMORY_BYTES)",
                field="x", limit="max_request_memory_bytes", estimate=est.memory_bytes,
            )
        if self.max_flops is not None and est.flops > self.max_flops:
            raise BudgetExceededError(
                f"{what} needs an estimated {est.flops:,.0f} floating-point operations, over "
                f"the limit of {self.max_flops:,.0f} (DXSERVE_MAX_REQUEST_FLOPS)",
                field="x", limit="max_request_flops", estimate=est.flops,
            )
        if self.max_seconds is not None:
            seconds = self.seconds(est)
            if seconds > self.max_seconds:
                raise BudgetExceededError(
                    f"{what} would take an estimated {seconds:,.1f} s ({est.flops:,.0f} flops "
                    f"at {self.flops_per_second:,.0f}/s, {est.bytes_accessed:,.0f} bytes accessed "
                    f"and {est.memory_bytes:,} needed, at {self.bytes_per_second:,.0f}/s), over the {self.max_seconds:g} s request "
                    "timeout (DXSERVE_REQUEST_TIMEOUT); a computation cannot be stopped once "
                    "started, so it is refused",
                    field="x", limit="request_timeout", estimate=seconds,
                )
        return est


class InFlight:
    """Bytes held by requests in flight, and large results being computed.

    ``take(n)`` admits ``n`` more bytes while the total stays within ``limit``, or when
    nothing else is held (so one request larger than the budget alone still runs);
    otherwise it raises ``OverloadedError`` (503 with ``Retry-After``). ``force(n)``
    counts bytes that exist already (a computed result) without refusing.
    """

    def __init__(self, limit: int, large_result_bytes: int, max_large_results: int) -> None:
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.refused = 0
        self.large_result_bytes = large_result_bytes
        self.max_large_results = max_large_results
        self.large = 0
        self._lock = threading.Lock()  # large slots only: a worker thread may take one
        #: told of the bytes each ``give`` hands back (the server trims its heap after
        #: large ones: ``memory.Trimmer``)
        self.on_give: Callable[[int], None] | None = None

    # --- bytes (event loop only) -------------------------------------------------
    def take(self, nbytes: int, what: str = "request") -> None:
        used = self.used + nbytes
        if used > self.limit and self.used:
            self.refused += 1
            raise OverloadedError(
                f"{self.used:,} bytes are held by requests in flight; this {what} needs "
                f"{nbytes:,} more, over the budget of {self.limit:,} "
                "(DXSERVE_MAX_INFLIGHT_BYTES); retry shortly",
                field="body", retry_after=1,
            )
        self.used = used
        if used > self.peak:
            self.peak = used

    def force(self, nbytes: int) -> None:
        self.used += nbytes
        if self.used > self.peak:
            self.peak = self.used

    def give(self, nbytes: int) -> None:
        self.used -= nbytes
        if self.on_give is not None:
            self.on_give(nbytes)

    # --- large results (any thread) -------------------------------------------------
    def is_large(self, result_bytes: int) -> bool:
        return result_bytes >= self.large_result_bytes

    def take_large(self, result_bytes: int) -> None:
        """Take a slot for a result of ``result_bytes`` (503 when all are taken)."""
        with self._lock:
            if self.large >= self.max_large_results:
                self.refused += 1
                raise OverloadedError(
                    f"{self.large} results of {self.large_result_bytes:,} bytes or more are "
                    f"being computed (DXSERVE_MAX_LARGE_RESULTS); this one would be "
                    f"{result_bytes:,} bytes; retry shortly",
                    field="x", retry_after=2,
                )
            self.large += 1

    def give_large(self) -> None:
        with self._lock:
            self.large -= 1


class Ticket:
    """The bytes one request holds in an ``InFlight`` budget; ``hold`` grows or shrinks it."""

    __slots__ = ("budget", "held")

    def __init__(self, budget: InFlight) -> None:
        self.budget = budget
        self.held = 0

    def hold(self, nbytes: int, what: str = "request") -> None:
        """Hold ``nbytes`` in total (503 if growing past the budget)."""
        if nbytes > self.held:
            self.budget.take(nbytes - self.held, what)
        else:
            self.budget.give(self.held - nbytes)
        self.held = nbytes

    def release(self) -> None:
        self.budget.give(self.held)
        self.held = 0
