"""Admission: the bytes requests hold at once, and what each one holds.

``Budget`` (one per ``Service``) counts the bytes held by requests in flight
(``DXSERVE_MAX_INFLIGHT_BYTES``) and the large results being computed at once
(``DXSERVE_LARGE_RESULT_BYTES`` / ``DXSERVE_MAX_LARGE_RESULTS``). A request's ``Ticket``
is its share, from admission until the last byte of its answer has been written:

* its body: what the declared length takes to decode, taken before a byte is read (or,
  without a declared length, what has been read so far); once decoded, what the inputs
  take (about the body's size);
* its result: from the moment the result's size is known (at preparation, before the
  computation runs) the result and what its encoding takes, until the answer is written;
  a large result also holds one of the large-result slots while it is computed.

Growing past the budget is refused with ``OverloadedError`` (503 with ``Retry-After``),
except for a request alone: when nothing else is held, one request larger than the whole
budget is still served. Bodies and results up to ``SMALL_BYTES`` are not counted; the
connection, queue and size limits bound those. ``Ticket.release`` gives everything back
and may be called more than once, so every exit path simply calls it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from dxcontract.errors import OverloadedError

#: Bodies and results up to this many bytes are not counted.
SMALL_BYTES = 256 * 1024


class Budget:
    """Bytes held by requests in flight, and large results being computed (any thread)."""

    def __init__(self, limit: int, large_result_bytes: int, max_large_results: int) -> None:
        self.limit = limit
        self.large_result_bytes = large_result_bytes
        self.max_large_results = max_large_results
        #: bytes held now, the most held at once, requests refused
        self.used = 0
        self.peak = 0
        self.refused = 0
        #: large results being computed now
        self.large = 0
        #: answers being written now (``http.sending``: started, not yet taken in full)
        self.sending = 0
        #: answers begun through the send path, ever
        self.answers = 0
        #: told the bytes each time some are given back (the service's memory trimmer)
        self.on_give: Callable[[int], None] | None = None
        self._lock = threading.Lock()

    def ticket(self, encode_factor: float = 0.0) -> Ticket:
        """A new request's (empty) share; ``encode_factor``: encoded bytes per result
        byte, beside the result itself, in the answer's encoding."""
        return Ticket(self, encode_factor)

    def is_large(self, result_bytes: int) -> bool:
        return result_bytes >= self.large_result_bytes

    def hold_written(self, delta: int) -> None:
        """Hold (``delta`` > 0) or give back bytes of answers being written, never
        refused: they exist already, and counting them refuses the requests after them."""
        if delta:
            self._change(delta, "answer", refuse=False)

    def _change(self, delta: int, what: str, refuse: bool = True) -> None:
        with self._lock:
            used = self.used + delta
            if refuse and delta > 0 and used > self.limit and self.used:
                self.refused += 1
                raise OverloadedError(
                    f"{self.used:,} bytes are held by requests in flight; this {what} needs "
                    f"{delta:,} more, over the budget of {self.limit:,} "
                    "(DXSERVE_MAX_INFLIGHT_BYTES); retry shortly",
                    field="body" if what == "body" else "x", retry_after=1,
                )
            self.used = used
            if used > self.peak:
                self.peak = used
        if delta < 0 and self.on_give is not None:
            self.on_give(-delta)

    def _take_large(self, result_bytes: int) -> None:
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

    def _give_large(self) -> None:
        with self._lock:
            self.large -= 1


class Ticket:
    """One request's share of a ``Budget`` (see the module). A context manager: leaving
    the ``with`` block releases it."""

    __slots__ = ("body", "budget", "encode_factor", "large", "result")

    def __init__(self, budget: Budget, encode_factor: float = 0.0) -> None:
        self.budget = budget
        self.encode_factor = encode_factor
        self.body = 0  # bytes held for the body and the decoded inputs
        self.result = 0  # bytes held for the result and its encoding
        self.large = False  # a large-result slot is held

    @property
    def held(self) -> int:
        return self.body + self.result

    def hold_body(self, nbytes: int) -> None:
        """Hold ``nbytes`` for the body (in total, not more): 503 when growing past the
        budget. Up to ``SMALL_BYTES`` nothing is held."""
        nbytes = nbytes if nbytes > SMALL_BYTES else 0
        if nbytes != self.body:
            self.budget._change(nbytes - self.body, "body")
            self.body = nbytes

    def reserve_result(self, result_bytes: int) -> None:
        """Before the computation runs: hold its result of ``result_bytes`` and what
        encoding it takes, and a large-result slot for a large one (503 past either)."""
        if result_bytes <= SMALL_BYTES or self.result:
            return
        total = int(result_bytes * (1 + self.encode_factor))
        self.budget._change(total, "result")
        self.result = total
        if self.budget.is_large(result_bytes) and not self.large:
            try:
                self.budget._take_large(result_bytes)
            except OverloadedError:
                self.budget._change(-total, "result")
                self.result = 0
                raise
            self.large = True

    def computed(self) -> None:
        """The computation is over: give back its large-result slot (the bytes stay
        held until the answer is written)."""
        if self.large:
            self.large = False
            self.budget._give_large()

    def release(self) -> None:
        """Give back everything this ticket holds (again: nothing happens)."""
        self.computed()
        held = self.held
        self.body = self.result = 0
        if held:
            self.budget._change(-held, "request")

    def __enter__(self) -> Ticket:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()
