"""Budgets: what one request may cost, known before it runs.

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

What all requests hold at once is ``admission``'s.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from dxcontract.errors import BudgetExceededError

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
    #: how a ``Sparse`` backend finds and colours its pattern, within which bounds (a
    #: ``backends.sparse_detection.Detector``; None: in the preparing thread, unbounded)
    sparsity: Any = None

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
