"""Compute limits: what one request may cost, known before it runs.

Per request (``ComputeLimits``): the function's framework estimates how much device
memory a compiled executable needs (arguments, outputs, temporaries, generated code)
and how much work it does (flops, transcendentals, bytes accessed); for JAX that is
XLA's own analysis (``frameworks/jax.py``). ``preparation`` reads it
once, when it compiles, and refuses with ``BudgetExceededError`` (422) an operator over
a bound, before it ever runs. XLA cannot interrupt a running executable, so this
refusal is the only bound on device time: an operator whose estimate at the assumed
(conservative) rates exceeds the request timeout is refused, not started.

Functions JAX cannot trace (server-side numpy code) have no
analysis and are not bounded here: they are trusted code.

What all requests hold at once is ``admission``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dxcontract.errors import BudgetExceededError
from dxserve.frameworks import Estimate, get_framework

#: Each byte an executable needs counts this many bytes of traffic in the time estimate:
#: fresh buffers are allocated, zeroed by the OS and first touched, which on CPU costs
#: far more per byte than re-reading data the caches hold (measured: an n⁴ gradient
#: with 1 GB of temporaries ran 5x longer than its traffic alone predicts).
ALLOCATION_WEIGHT = 10


def estimate(executable: Any, framework: Any = None) -> Estimate | None:
    """``executable``'s memory and work as its framework estimates them (JAX: XLA's
    analyses), or None where it gives none. ``framework``: the one that compiled it
    (None: the default, JAX)."""
    return (framework or get_framework()).estimate(executable)


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

    def check(self, executable: Any, what: str, framework: Any = None) -> Estimate | None:
        """Raise ``BudgetExceededError`` if ``executable`` (compiled by ``framework``, None:
        JAX) is over a bound; its estimate."""
        est = estimate(executable, framework)
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
