"""Bounded connections: uvicorn's httptools protocol with read, write and size limits.

The one module of dxserve that builds on uvicorn's internals, and only here:
``bounded_protocol(limits)`` subclasses ``HttpToolsProtocol`` with ``BoundedConnection``
(the limits' class attribute set), and the class is plugged in through uvicorn's public
``http=`` option (``dxserve serve`` does it; see ``cli.connection_options``). It is written
against the uvicorn versions the package pins and checked against the lowest and the
highest of them in CI. With any other version, without httptools, or with
``DXSERVE_HTTP=h11``, ``bounded_protocol`` returns None: the server runs on uvicorn's own
protocol and its log says which of these protections are off.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) and answers 503 past
``limit_concurrency`` once a request's headers are in. It does not bound how long a
client may take to send a request's headers or body, so a connection trickling a byte
every few seconds holds a file descriptor for ever; nothing bounds the headers' size
with httptools; and an answer to a client that never reads waits in memory for ever.
The protocol here adds, per connection:

* headers: complete within ``header_timeout`` seconds of the connection opening (first
  request) or of the request's first byte (later ones), and at most
  ``max_header_bytes`` bytes (request line and header lines): 408 and 431, then closed;
* body: complete within ``body_timeout`` seconds once the headers are in: 408, closed;
* connections: past ``max_connections`` open ones, a new one is answered 503 and closed;
* writes: a client that takes nothing of an answer for ``write_timeout`` seconds while
  the server has more to send (the transport's buffer is full) is disconnected, so what
  was waiting for it is freed.

And two things for speed:

* an answer's head is held back and written with its body's first parts, in one system
  call (``_HeadWithBody``): ASGI sends them as separate messages, and each write is a
  system call that costs as much as a small gradient;
* a body the application has admitted whole goes straight to it (``BODY_SINK``): uvicorn
  pauses reading every 64 KiB until the application asks for more, and copies each
  piece twice on its way (about 1.5 ms of an 8 MB body). Reading does not wait for the
  application before it has admitted the body (its bytes reserved), so an unadmitted
  body still holds at most uvicorn's 64 KiB.

No read timer runs while the application works on a complete request (the request
timeout bounds that). The timers cost one ``call_at`` and one ``cancel`` per request.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

from dxcontract.codec import dumps
from dxcontract.errors import DxError, MalformedRequestError, OverloadedError, RequestTimeoutError
from dxserve.http.problems import PROBLEM_TYPE, problem_document

log = logging.getLogger("dxserve.http")

#: uvicorn versions this module is written and tested against: [lowest, above highest)
UVICORN_VERSIONS = ((0, 46), (0, 55))

#: The scope key of a request's body sink: ``scope[BODY_SINK](add)``, called by the
#: application once it has admitted a body of declared length, sends the body's bytes
#: received so far and each later piece to ``add`` as it arrives; reading no longer
#: pauses for the application, which wakes once, when the body is complete (its
#: ``receive`` then gives empty bodies). Without the key (h11, another server), the
#: application reads the body from ``receive`` as usual.
BODY_SINK = "dxserve.body_sink"

# what the parser of one connection is doing
_HEAD, _BODY, _APP = "head", "body", "app"
_END_OF_HEAD = b"\r\n\r\n"


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds ``bounded_protocol`` enforces (seconds, bytes, connections)."""

    header_timeout: float = 10.0
    body_timeout: float = 120.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 4096
    write_timeout: float = 60.0

    def describe(self) -> str:
        return (
            f"headers within {self.header_timeout:g} s and {self.max_header_bytes} bytes, "
            f"bodies within {self.body_timeout:g} s, {self.max_connections} connections, "
            f"unread answers dropped after {self.write_timeout:g} s"
        )


#: What ``DXSERVE_HTTP=h11`` leaves off (the server logs it): h11 bounds heads and
#: trailers itself (``h11_max_incomplete_event_size``), and ``CappedH11`` adds the write
#: timeout and the connection cap.
H11_UNPROTECTED = (
    "header and body read timeouts are off (a client trickling its request holds a "
    "connection until uvicorn's limit_concurrency); heads and trailers are bounded by "
    "h11 to DXSERVE_MAX_HEADER_BYTES, unread answers are cut off after the write timeout"
)

#: What is off when ``bounded_protocol`` returns None (the server logs it).
UNPROTECTED = (
    "header and body read timeouts, the exact header size limit, the connection cap and "
    "the write timeout are off (uvicorn's own limits apply: keep-alive timeout, "
    "limit_concurrency, h11_max_incomplete_event_size); put a proxy in front "
    "(docker/nginx.conf)"
)


def raw_problem(status: int, reason: str, error: DxError, *headers: str) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response carrying ``error``'s problem
    document, for answers the protocol writes itself (no application involved)."""
    body = dumps(problem_document(error, status))
    lines = [
        f"HTTP/1.1 {status} {reason}",
        f"content-type: {PROBLEM_TYPE}",
        f"content-length: {len(body)}",
        "connection: close",
        *headers,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def supported_uvicorn(version: str) -> bool:
    """Is ``version`` (uvicorn's) one this module is written for?"""
    try:
        found = tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return False
    low, high = UVICORN_VERSIONS
    return low <= found < high


class WriteBound:
    """The write timeout and the connection cap, as a mixin over either of uvicorn's
    protocols (httptools or h11): a client that takes nothing of its answer for
    ``write_timeout`` seconds while the transport's buffer is full is disconnected, and
    what waited for it (the answer, its budget) is freed."""

    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def connection_made(self, transport: Any) -> None:
        self._write_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_write_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.write_timeout, self._stalled)

    def resume_writing(self) -> None:
        self._stop_write_timer()
        super().resume_writing()

    def _stop_write_timer(self) -> None:
        timer = getattr(self, "_write_timer", None)
        if timer is not None:
            timer.cancel()
            self._write_timer = None

    def _stalled(self) -> None:
        self._write_timer = None
        log.info(
            "closing %s: it took nothing of its answer for %g s",
            self.client, self.limits.write_timeout,
        )
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            # before the abort: closing the transport may resume writing at once (uvloop
            # does), and the answer's next write must find its client gone
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.abort()  # close() would wait for the client to read


class CappedH11(WriteBound):
    """uvicorn's h11 protocol with the write timeout and the connection cap. h11 itself
    bounds a request's head and a chunked body's trailers to
    ``h11_max_incomplete_event_size`` (set to ``DXSERVE_MAX_HEADER_BYTES``: 400, closed);
    read timeouts are not added (see ``H11_UNPROTECTED``)."""

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            error = OverloadedError(
                f"the server holds its limit of {self.limits.max_connections} open "
                "connections; retry shortly", retry_after=1,
            )
            transport.write(raw_problem(503, "Service Unavailable", error, "retry-after: 1"))
            transport.close()


class BoundedConnection(WriteBound):
    """The limits and fast paths of this module, as a mixin over uvicorn's
    ``HttpToolsProtocol`` (the class that follows it in the bases supplies the parsing,
    the cycle and the flow control). ``limits`` is read per connection:
    ``bounded_protocol`` makes the subclass that sets it."""

    #: the bounds this protocol enforces; set by ``bounded_protocol`` on its subclass
    limits: ClassVar[ConnectionLimits] = ConnectionLimits()

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._timer: asyncio.TimerHandle | None = None
        self._sink: tuple[Any, Any] | None = None  # (cycle, add): see ``BODY_SINK``
        self._phase = _HEAD
        self._deadline = self.loop.time() + self.limits.header_timeout
        self._begin_head(by_parser=False)
        #: an oversized head behind a request still being answered: refused after it
        self._refusing: DxError | None = None
        if len(self.connections) > self.limits.max_connections:
            self._refuse(503, "Service Unavailable", OverloadedError(
                f"the server holds its limit of {self.limits.max_connections} open "
                "connections; retry shortly", retry_after=1,
            ), "retry-after: 1")
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._sink = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusing is not None:  # nothing more is read on this connection
            return
        if self._phase == _APP:  # the first bytes of the next request (or of junk)
            self._begin()
        if self._phase == _HEAD and self._count_raw(data):
            return
        if self._phase != _BODY:
            super().data_received(data)
            return
        before, head = self._body_bytes, self._head_start
        super().data_received(data)
        # the same body goes on (no request ended and began in this read): count what
        # was not body
        if self._phase == _BODY and self._head_start is head:
            self._count_framing(len(data), self._body_bytes - before)

    # --- a chunked body's framing and trailers ------------------------------------
    # The parser takes trailer lines after the last chunk (and extensions on chunk
    # lines) without bound, keeping each line whole in memory. Bytes of a body that are
    # not body count against the header limit, less the body bytes beside them: chunk
    # lines cost a few bytes per chunk of data, trailers and extensions cost in full.
    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        sink = self._sink
        if sink is None or sink[0] is not self.cycle or self.cycle.response_complete:
            super().on_body(body)
            return
        try:
            sink[1](body)
        except Exception:  # the admitted length holds it: a broken sink ends the request
            log.exception("a body sink failed; closing %s", self.client)
            self._sink = None
            self._disconnect_cycle()
            self.transport.close()

    def _sink_body(self, of: weakref.ref, add: Any) -> None:
        """The body of the cycle ``of`` refers to goes to ``add`` from now on (see
        ``BODY_SINK``)."""
        cycle = of()
        if cycle is None or self.cycle is not cycle:
            return
        if cycle.response_complete or cycle.disconnected:
            return
        if cycle.body:
            add(bytes(cycle.body))
            cycle.body = cycle.body[:0]
        self._sink = (cycle, add)
        self.flow.resume_reading()

    def _count_framing(self, received: int, body: int) -> None:
        self._framing = max(0, self._framing + received - 2 * body)
        if self._framing > self.limits.max_header_bytes and not self.transport.is_closing():
            error = MalformedRequestError(
                f"chunked body framing or trailers exceed {self.limits.max_header_bytes} "
                "bytes (DXSERVE_MAX_HEADER_BYTES)", field="trailers",
            )
            cycle = self.cycle
            self._disarm()
            self._phase = _APP
            self._disconnect_cycle()
            if cycle is None or not cycle.response_started:
                self.transport.write(raw_problem(431, "Request Header Fields Too Large", error))
            self.transport.close()

    # --- the head's size ------------------------------------------------------------
    # A head that starts where a read starts is counted from the raw bytes, exactly.
    # One that starts inside a read (pipelined behind a body) is counted from what
    # the parser reports (request line and header lines as sent with ": "), and its
    # later reads from the raw bytes as well, so neither can grow past the limit.
    def _begin_head(self, by_parser: bool) -> None:
        self._head_start = object()  # a new token for each request's head
        self._body_bytes = 0  # the body's bytes so far (its framing not counted)
        self._framing = 0  # bytes of the body's framing and trailers, less body bytes
        self._head_bytes = 0  # raw bytes of the head so far
        self._parsed_bytes = 0  # bytes the parser has reported (by_parser only)
        self._tail = b""  # the last bytes of the head: a CRLF CRLF may span reads
        self._by_parser = by_parser

    def _count_raw(self, data: bytes) -> bool:
        """Count the head bytes in ``data``; True when past the limit (refused)."""
        seen = self._tail + data
        end = seen.find(_END_OF_HEAD)
        if end < 0:
            self._head_bytes += len(data)
            self._tail = seen[-3:]
        else:  # the head ends in this read: what follows is body, or the next request
            self._head_bytes += end + len(_END_OF_HEAD) - len(self._tail)
            self._tail = b""
        return self._head_bytes > self.limits.max_header_bytes and self._too_large()

    def _count_parsed(self, nbytes: int) -> bool:
        self._parsed_bytes += nbytes
        return self._parsed_bytes > self.limits.max_header_bytes and self._too_large()

    def _too_large(self) -> bool:
        error = MalformedRequestError(
            f"request headers exceed {self.limits.max_header_bytes} bytes", field="headers",
        )
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete and self._by_parser:
            # pipelined behind a request still being answered: answer that one first
            self._refusing = error
            self.flow.pause_reading()
        else:
            self._refuse(431, "Request Header Fields Too Large", error)
        return True

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._phase != _HEAD:  # a pipelined request began inside a read
            self._begin(by_parser=True)

    def on_url(self, url: bytes) -> None:
        if self._refusing is not None or self.transport.is_closing():
            return
        super().on_url(url)
        if self._by_parser:  # "METHOD url HTTP/1.1\r\n"
            first = not self._parsed_bytes
            extra = len(self.parser.get_method()) + len(" HTTP/1.1\r\n") + 1 if first else 0
            self._count_parsed(len(url) + extra)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._refusing is not None or self.transport.is_closing():
            return
        super().on_header(name, value)
        if self._by_parser:
            self._count_parsed(len(name) + len(value) + 4)  # ": " and CRLF

    def on_headers_complete(self) -> None:
        if self._refusing is not None or self.transport.is_closing():
            return
        if self._by_parser and self._count_parsed(2):
            return
        self._phase = _BODY  # the armed timer moves on to this deadline when it fires
        self._deadline = self.loop.time() + self.limits.body_timeout
        if self.limits.body_timeout < self.limits.header_timeout:  # ... unless it comes sooner
            self._disarm()
            self._arm()
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is None or cycle.scope is not self.scope:  # an upgrade: not ours
            return
        cycle.transport = out = _HeadWithBody(self.transport, self.loop)
        cycle.on_response = out.then(cycle.on_response)  # whole: what it held goes
        self._sink = None
        # a weak reference: the scope holding its own cycle would keep both for the collector
        cycle.scope[BODY_SINK] = partial(self._sink_body, weakref.ref(cycle))

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._sink = None  # the body is whole: nothing of the request stays held here
        self._phase = _APP
        self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._refusing is not None and not self.transport.is_closing():
            self._refuse(431, "Request Header Fields Too Large", self._refusing)

    # --- read timers ----------------------------------------------------------------
    def _begin(self, by_parser: bool = False) -> None:
        self._phase = _HEAD
        self._begin_head(by_parser)
        self._deadline = self.loop.time() + self.limits.header_timeout
        self._disarm()
        self._arm()

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = self.loop.call_at(self._deadline, self._expired)

    def _disarm(self) -> None:
        timer = getattr(self, "_timer", None)
        if timer is not None:
            timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        if self._phase == _APP or self.transport.is_closing():
            return
        if self.loop.time() < self._deadline:  # the deadline moved on (headers done)
            self._arm()
            return
        if self.pipeline:  # a pipelined request waits unread behind one still running:
            self._deadline = self.loop.time() + self.limits.body_timeout  # not its sender's
            self._arm()  # fault; the one before it is bounded by the request timeout
            return
        if self._phase == _HEAD:
            what, limit = "headers", self.limits.header_timeout
        else:
            what, limit = "body", self.limits.body_timeout
        log.info("closing %s: request %s not received within %g s", self.client, what, limit)
        error = RequestTimeoutError(
            f"the request {what} did not arrive within {limit:g} s", field=what
        )
        cycle = self.cycle if self._phase == _BODY else None
        if cycle is None or not cycle.response_started:
            self.transport.write(raw_problem(408, "Request Timeout", error))
        self._disconnect_cycle()
        self.transport.close()

    def _refuse(self, status: int, reason: str, error: DxError, *headers: str) -> None:
        self._disarm()
        self._phase = _APP
        self._disconnect_cycle()
        self.transport.write(raw_problem(status, reason, error, *headers))
        self.transport.close()

    def _disconnect_cycle(self) -> None:
        """The request being served sees its client gone (and sends nothing more)."""
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()


def bounded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol with ``limits`` (``BoundedConnection`` before
    ``HttpToolsProtocol``), for uvicorn's ``http=`` option; None where it cannot be built
    (no httptools, or a uvicorn outside ``UVICORN_VERSIONS``)."""
    try:
        import uvicorn
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None
    if not supported_uvicorn(uvicorn.__version__):
        return None
    return type(
        "BoundedHttpToolsProtocol", (BoundedConnection, HttpToolsProtocol), {"limits": limits}
    )


def bounded_h11_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol] | None:
    """uvicorn's h11 protocol with the write timeout and connection cap of ``limits``
    (``CappedH11``); None where it cannot be built (a uvicorn outside
    ``UVICORN_VERSIONS``)."""
    try:
        import uvicorn
        from uvicorn.protocols.http.h11_impl import H11Protocol
    except ImportError:
        return None
    if not supported_uvicorn(uvicorn.__version__):
        return None
    return type("BoundedH11Protocol", (CappedH11, H11Protocol), {"limits": limits})



#: an answer's writes are held back together up to this many bytes
HOLD_BYTES = 64 * 1024


class _HeadWithBody:
    """The transport one answer is written through: its first writes (the head, then
    small parts of the body) are held back and go out together, in one system call,
    with the write that brings them to ``HOLD_BYTES`` or when the answer is complete.
    Writes that do not complete the answer within the same turn of the event loop (an
    event stream's first event) go out at the end of that turn; later ones go straight
    through."""

    __slots__ = ("_held", "_held_bytes", "_loop", "_started", "_transport")

    def __init__(self, transport: Any, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: list[Any] | None = None
        self._held_bytes = 0
        self._started = False

    def write(self, data: Any) -> None:
        if not self._started:
            self._started = True
            self._held, self._held_bytes = [data], len(data)
            self._loop.call_soon(self.flush)
            return
        held = self._held
        if held is None:
            if not self._transport.is_closing():  # uvloop raises on a closed transport
                self._transport.write(data)
            return
        if len(data):
            held.append(data)
            self._held_bytes += len(data)
            if self._held_bytes >= HOLD_BYTES:
                self.flush()

    def flush(self) -> None:
        """Send what is held (the answer is complete, or its turn is over)."""
        held = self._held
        if held is not None:
            self._held = None
            if not self._transport.is_closing():
                if len(held) == 1:
                    self._transport.write(held[0])
                else:
                    self._transport.writelines(held)

    def then(self, on_response: Any) -> Any:
        """``on_response`` (called once the answer is complete), flushing first."""

        def answered() -> None:
            self.flush()
            on_response()

        return answered

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def close(self) -> None:
        self.flush()
        self._transport.close()
