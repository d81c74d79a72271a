"""Bounded connections: read timeouts for headers and bodies, and caps on connections
and header bytes, in the HTTP protocol itself.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) and answers 503 past
``limit_concurrency`` once a request's headers have arrived; it does not bound how long
a client may take to send a request's headers or body, so a connection that trickles a
byte every few seconds (or sends nothing at all) holds a file descriptor for ever, and
with httptools nothing bounds the size of the headers either. ``bounded_protocol`` is
uvicorn's httptools protocol with those bounds:

* a request's headers must be complete within ``header_timeout`` seconds of the
  connection opening (first request) or of the request's first byte (later ones), and
  hold at most ``max_header_bytes`` (431 past it);
* once the headers are in, the whole body must arrive within ``body_timeout`` seconds;
* past ``max_connections`` open connections, a new one is answered 503 and closed at once.

The event loop reads each connection through a ``_Reader`` in front of the protocol,
at most 16 KiB at a time until a request's head is in and 64 KiB after (uvloop's own
reads take 256 KiB): the head of a large request is parsed, and its application
started, while the body is still arriving. A request whose ``Content-Length`` is at
least ``inbox_min_bytes`` (and at most ``max_body_bytes``) is received into one buffer
of exactly that size: when the application first asks for the body (after its limits
and in-flight budget accepted the declared length: nothing is allocated for a body it
refuses unread), the buffer is allocated, what uvicorn holds already is copied in, and
the event loop reads the rest of the body straight into it; reading is no longer
paused every 64 KiB to hand the application a chunk (uvicorn's flow control), and the
application gets the whole body as one message when the last byte is in. The buffer is
new per request (for a binary body, 64-byte aligned, so its arrays can be used by the
device as they are), owned by that request alone: arrays decoded from it as views can
never see the bytes of a later request. Larger declared lengths are left
to the application, which refuses them (413) before reading.

A POST to an operator path is served by the app's operator lane (see ``lane``)
instead of uvicorn's request-response cycle: the protocol completes its scope at the
headers and starts one task that runs the lane and writes its answer (``_LaneCycle``),
when a small body is in, or at once for one received into one buffer as above. Every
other request goes uvicorn's way.

A request that runs out of time is answered 408 (problem+json) if no response has
started, and its connection is closed. No read timer runs while the application works
on a complete request (``request_timeout`` bounds computations), and between requests
uvicorn's keep-alive timeout applies. The timers cost one ``call_at`` and one
``cancel`` per request.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

try:
    import httptools
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
except ImportError:  # pragma: no cover - uvicorn[standard] brings httptools
    httptools = None

from dxclient.codec import BINARY_TYPE, dumps
from dxclient.errors import (
    DxError,
    InternalError,
    MalformedRequestError,
    OverloadedError,
    RequestTimeoutError,
)

from .problems import PROBLEM_TYPE, problem_document
from .routes import LOOP

log = logging.getLogger("dxserve.http")

_BINARY_TYPE = BINARY_TYPE.encode("latin-1")

# what the parser of one connection is doing
_HEAD, _BODY, _APP, _IDLE = "head", "body", "app", "idle"


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds ``bounded_protocol`` enforces (seconds, bytes, connections)."""

    header_timeout: float = 10.0
    body_timeout: float = 120.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 4096
    #: bodies declaring at least this many bytes are received into one buffer
    inbox_min_bytes: int = 64 * 1024
    #: ... and at most this many (the application refuses larger ones before reading)
    max_body_bytes: int = 256 * 1024 * 1024


#: the most one read takes outside a large body: 64 KiB, as much as uvicorn holds of
#: a body before it stops reading, so smaller bodies still come in one read ...
READ_BYTES = 64 * 1024
#: ... once the head is in; until then 16 KiB (a small request whole): what a large
#: body's first read brings along goes through the parser and is copied three times
HEAD_READ_BYTES = 16 * 1024
_READS = threading.local()


def _read_buffer() -> memoryview:
    """This thread's read buffer: each read is copied out before the next one, and an
    event loop runs in one thread."""
    view = getattr(_READS, "view", None)
    if view is None:
        view = _READS.view = memoryview(bytearray(READ_BYTES))
    return view


def raw_problem(status: int, reason: str, error: DxError, *headers: str) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response carrying ``error``'s problem
    document, for answers written by the protocol itself (no application involved)."""
    body = dumps(problem_document(error, status))
    lines = [
        f"HTTP/1.1 {status} {reason}",
        f"content-type: {PROBLEM_TYPE}",
        f"content-length: {len(body)}",
        "connection: close",
        *headers,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def bounded_protocol(limits: ConnectionLimits) -> type[asyncio.Protocol] | None:
    """uvicorn's httptools protocol with ``limits``; None without httptools (then only
    uvicorn's own options apply: see ``cli``)."""
    if httptools is None:  # pragma: no cover - uvicorn[standard] brings httptools
        return None

    body_sooner = limits.body_timeout < limits.header_timeout

    class BoundedHttpToolsProtocol(HttpToolsProtocol):
        """``HttpToolsProtocol`` whose requests must arrive in time (see the module)."""

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._reader: _Reader | None = None
            if hasattr(transport, "set_protocol"):  # the event loop reads through it
                self._reader = _Reader(self)
                transport.set_protocol(self._reader)
            self._timer: asyncio.TimerHandle | None = None
            self._phase = _HEAD
            self._header_bytes = 0
            self._deadline = self.loop.time() + limits.header_timeout
            self._inbox: bytearray | None = None
            self._inbox_got = 0
            self._inbox_cycle: Any = None
            self._lane, self._lane_proxied = _lane_of(self.config)
            self._fresh_context = getattr(self.config, "reset_contextvars", False)
            if len(self.connections) > limits.max_connections:
                self._refuse(
                    503, "Service Unavailable",
                    OverloadedError(
                        f"the server holds its limit of {limits.max_connections} open "
                        "connections; retry shortly",
                        retry_after=1,
                    ),
                    "retry-after: 1",
                )
                return
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._inbox = None
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                return
            if self._phase == _IDLE:  # bytes that began no request yet (e.g. a lone CRLF)
                self._begin()
            if self._phase == _HEAD:  # the whole chunk after the request began is header
                self._header_bytes += len(data)
                if self._header_bytes > limits.max_header_bytes:
                    self._refuse(
                        431, "Request Header Fields Too Large",
                        MalformedRequestError(
                            f"request headers exceed {limits.max_header_bytes} bytes",
                            field="headers",
                        ),
                    )

        def on_message_begin(self) -> None:
            super().on_message_begin()
            if self._phase != _HEAD:  # a later request: its own header deadline
                self._begin()

        def on_headers_complete(self) -> None:
            self._phase = _BODY  # the armed timer moves on to this deadline when it fires
            self._deadline = self.loop.time() + limits.body_timeout
            if body_sooner:  # ... unless it comes before the armed one
                self._disarm()
                self._arm()
            if self._lane is not None and self._to_lane():
                return
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is None or cycle.scope is not self.scope:  # an upgrade: not ours
                return
            cycle.transport = out = _HeadWithBody(self.transport, self.loop)
            cycle.on_response = out.then(cycle.on_response)  # whole: what it held goes
            length = _framing(self.headers)[0]
            if limits.inbox_min_bytes <= length <= limits.max_body_bytes:
                # read by run_asgi when the task first runs, after this callback
                binary = _is_binary(self.headers)
                cycle.receive = _inbox_receive(self, cycle, length, binary)
                # nothing more read until the application takes the body: the rest
                # then goes straight into its buffer, not a read at a time through
                # the parser (uvicorn would read one more 64 KiB before pausing)
                self.flow.pause_reading()

        def on_body(self, body: bytes) -> None:
            cycle = self.cycle
            inbox = self._inbox
            if inbox is None or self._inbox_cycle is not cycle:
                if type(cycle) is not _LaneCycle:
                    super().on_body(body)
                elif not cycle.response_complete:
                    cycle.chunks.append(body)
                return
            if self.cycle.response_complete:  # answered early (e.g. 503): drop the rest
                return
            start = self._inbox_got
            end = start + len(body)
            if end > len(inbox):  # pragma: no cover - httptools frames by Content-Length
                self._inbox = None
                self._refuse(400, "Bad Request", MalformedRequestError(
                    "the body is longer than its Content-Length", field="body"))
                return
            inbox[start:end] = body  # same length: a copy in place, never a resize
            self._inbox_got = end

        def on_message_complete(self) -> None:
            cycle = self.cycle
            lane = type(cycle) is _LaneCycle
            if lane:
                cycle.more_body = False
                cycle.set()  # a large body's receive waits for its last byte
            else:
                super().on_message_complete()
            self._inbox = self._inbox_cycle = None  # its receive holds it; the next gets its own
            self._phase = _APP
            self._disarm()
            if lane and cycle.task is None and not cycle.response_complete:
                cycle.task = self._start(self._serve_lane(cycle))

        def on_response_complete(self) -> None:
            # the last request read is answered (none pipelined behind it): idle, and
            # uvicorn's keep-alive timer runs until the next request begins
            idle = self._phase == _APP and not self.pipeline
            super().on_response_complete()
            if idle:
                self._phase = _IDLE

        # --- the operator lane (see ``lane``) -------------------------------------------
        def _to_lane(self) -> bool:
            """Whether this request goes to the lane: if so, its scope is complete and
            ``self.cycle`` is its ``_LaneCycle``."""
            parser, cycle = self.parser, self.cycle
            if (
                self.expect_100_continue or (cycle is not None and not cycle.response_complete)
                or parser.get_method() != b"POST" or parser.should_upgrade()
            ):
                return False
            length, forwarded = _framing(self.headers)
            if not 0 <= length <= limits.max_body_bytes:
                return False
            most = self.limit_concurrency
            if most is not None and (len(self.connections) >= most or len(self.tasks) >= most):
                return False  # uvicorn's own way answers 503
            # the scope as uvicorn completes it
            scope = self.scope
            scope["method"] = "POST"
            version = parser.get_http_version()
            if version != "1.1":
                scope["http_version"] = version
            url = httptools.parse_url(self.url)
            path = url.path.decode("ascii")
            if "%" in path:
                path = urllib.parse.unquote(path)
            root = self.root_path
            scope["path"] = root + path if root else path
            scope["raw_path"] = root.encode("ascii") + url.path if root else url.path
            scope["query_string"] = url.query or b""
            scope[LOOP] = self.loop
            if not self._lane.takes(scope):
                return False
            keep_alive = version != "1.0" and parser.should_keep_alive()
            self.cycle = cycle = _LaneCycle(self, scope, keep_alive)
            # uvicorn's proxy-headers middleware changes nothing without these headers
            cycle.entry = self._lane_proxied if forwarded else self._lane
            if length >= limits.inbox_min_bytes:
                # received into one buffer when the endpoint takes it (after its limits
                # and in-flight budget accepted the length): it starts now, and nothing
                # more is read until then
                cycle.inbox_length, cycle.binary = length, _is_binary(self.headers)
                self.flow.pause_reading()
                cycle.task = self._start(self._serve_lane(cycle))
            return True

        def _start(self, coroutine: Any) -> asyncio.Task:
            """A task for ``coroutine``, counted in ``tasks`` (uvicorn's concurrency
            limit and graceful shutdown) until the coroutine takes it out itself: a
            done callback would cost the event loop one more turn per request."""
            if self._fresh_context:  # uvicorn's --reset-contextvars
                task = self.loop.create_task(coroutine, context=contextvars.Context())
            else:
                task = self.loop.create_task(coroutine)
            self.tasks.add(task)
            return task

        async def _serve_lane(self, cycle: _LaneCycle) -> None:
            try:
                await cycle.entry(cycle.scope, cycle.receive, cycle.send)
            except BaseException as exc:
                self.logger.error("Exception in the operator lane", exc_info=exc)
                if not cycle.response_started and not self.transport.is_closing():
                    self.transport.write(raw_problem(
                        500, "Internal Server Error",
                        InternalError(f"{type(exc).__name__}; the server logged it"),
                    ))
                self.transport.close()
                if not isinstance(exc, Exception):
                    raise
            finally:
                self.tasks.discard(cycle.task)
            if not cycle.response_complete:  # sent nothing: gone, or an error above
                cycle.response_complete = True
                self.on_response_complete()

        # --- timers ---------------------------------------------------------------------
        def _begin(self) -> None:
            self._phase = _HEAD
            self._header_bytes = 0
            self._deadline = self.loop.time() + limits.header_timeout
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
            if self._phase not in (_HEAD, _BODY) or self.transport.is_closing():
                return
            if self.loop.time() < self._deadline:  # the deadline moved on (headers done)
                self._arm()
                return
            if self.pipeline:  # a pipelined request waits unread behind one still running:
                self._deadline = self.loop.time() + limits.body_timeout  # not its sender's
                self._arm()  # fault; the one before it is bounded by request_timeout
                return
            if self._phase == _HEAD:
                what, limit = "headers", limits.header_timeout
            else:
                what, limit = "body", limits.body_timeout
            cycle = self.cycle if self._phase == _BODY else None
            log.info("closing %s: request %s not received within %g s", self.client, what, limit)
            error = RequestTimeoutError(
                f"the request {what} did not arrive within {limit:g} s", field=what
            )
            if cycle is None or not cycle.response_started:
                self.transport.write(raw_problem(408, "Request Timeout", error))
            if cycle is not None and not cycle.response_complete:
                # the application sees a disconnect and may send nothing more
                cycle.disconnected = True
                cycle.message_event.set()
            self.transport.close()

        def _refuse(self, status: int, reason: str, error: DxError, *headers: str) -> None:
            self._disarm()
            self._phase = _APP
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self.transport.write(raw_problem(status, reason, error, *headers))
            self.transport.close()

    return BoundedHttpToolsProtocol


def _lane_of(config: Any) -> tuple[Any, Any]:
    """``(lane, proxied)`` for the app ``config`` serves: its ``OperatorApp.lane()``, and
    the lane behind uvicorn's proxy-headers middleware when that is on (else the lane
    itself). ``(None, None)`` for an app of another kind, or one wrapped in anything else
    (the lane would skip it)."""
    app = getattr(config, "loaded_app", None)
    cached = getattr(config, "_dxserve_lane", None)
    if cached is not None and cached[0] is app:
        return cached[1]
    from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

    from .dispatch import OperatorApp

    inner = app.app if isinstance(app, ProxyHeadersMiddleware) else app
    lane = inner.lane() if isinstance(inner, OperatorApp) else None
    entry = lane
    if lane is not None and inner is not app:
        entry = ProxyHeadersMiddleware(lane, trusted_hosts=config.forwarded_allow_ips)
    config._dxserve_lane = (app, (lane, entry))
    return lane, entry


class _LaneCycle:
    """A request served by the operator lane: its body as it arrives, the ASGI
    ``receive`` it is read through, the ``send`` its answer is written with, and the
    state uvicorn's protocol and ours look at on ``cycle`` (pipelining, disconnects,
    timeouts, shutdown)."""

    __slots__ = (
        "binary", "chunks", "delivered", "disconnected", "entry", "inbox_length", "keep_alive",
        "more_body", "protocol", "response_complete", "response_started", "scope", "task",
        "waiter",
    )

    def __init__(self, protocol: Any, scope: dict, keep_alive: bool) -> None:
        self.protocol, self.scope, self.keep_alive = protocol, scope, keep_alive
        self.chunks: list[bytes] = []
        self.more_body = True
        self.delivered = self.disconnected = False
        self.response_started = self.response_complete = False
        self.waiter: asyncio.Future | None = None
        self.task: asyncio.Task | None = None
        self.entry: Any = None  # what serves it: the lane, or the lane behind proxy headers
        #: a body received into one buffer: its length, and whether it is binary framing
        self.inbox_length: int | None = None
        self.binary = False

    @property
    def message_event(self) -> _LaneCycle:
        """What uvicorn sets on a disconnect (``message_event.set()``)."""
        return self

    def set(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def receive(self) -> dict:
        """The whole body in the first message; later ones wait for the disconnect."""
        if not self.delivered:
            self.delivered = True
            if self.inbox_length is not None and self.more_body:
                return await self._receive_into_one_buffer()
            chunks = self.chunks
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            self.chunks = []
            return {"type": "http.request", "body": body, "more_body": False}
        while not self.disconnected and not self.response_complete:
            await self._wait()
        return {"type": "http.disconnect"}

    async def _wait(self) -> None:
        self.waiter = self.protocol.loop.create_future()
        await self.waiter

    async def _receive_into_one_buffer(self) -> dict:
        """A large body, received into one buffer of its length (see ``_inbox_receive``,
        uvicorn's cycle's counterpart)."""
        protocol = self.protocol
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        received = b"".join(self.chunks)
        self.chunks = []
        inbox = _open_inbox(protocol, self, self.inbox_length, self.binary, received)
        while self.more_body and not self.disconnected and not self.response_complete:
            protocol.flow.resume_reading()
            await self._wait()
        _close_inbox(protocol, inbox)
        if self.disconnected or self.response_complete:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": inbox, "more_body": False}

    async def send(self, status: int, headers: list[tuple[bytes, bytes]], parts: list[Any]) -> None:
        """Write the answer: head and parts in one write (or ``writelines``), then wait
        while the transport's buffer is full; then the next request may begin."""
        protocol = self.protocol
        if self.disconnected or self.response_complete or protocol.transport.is_closing():
            return
        self.response_started = True
        # uvicorn's access logger is set up even when its level drops every line
        if protocol.access_log and protocol.access_logger.isEnabledFor(logging.INFO):
            scope = self.scope
            protocol.access_logger.info(
                '%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                get_path_with_query_string(scope), scope["http_version"], status,
            )
        head = [STATUS_LINE[status]]
        closes = False  # the answer says so itself
        for name, value in (*protocol.server_state.default_headers, *headers):
            if name == b"connection" and b"close" in value.lower():
                self.keep_alive, closes = False, True
            head += (name, b": ", value, b"\r\n")
        if not self.keep_alive and not closes:
            head.append(b"connection: close\r\n")
        head.append(b"\r\n")
        transport = protocol.transport
        if len(parts) == 1 and len(parts[0]) < HOLD_BYTES:
            head.append(parts[0])
            transport.write(b"".join(head))
        else:
            transport.writelines([b"".join(head), *parts])
        if protocol.flow.write_paused and not self.disconnected:
            await protocol.flow.drain()
        self.response_complete = True
        if not self.keep_alive:
            transport.close()
        protocol.on_response_complete()


#: an answer's writes are held back together up to this many bytes (see _HeadWithBody)
HOLD_BYTES = 64 * 1024


class _HeadWithBody:
    """The transport one request's answer is written through: its first writes (the
    head, then small parts of the body) are held back and go out together, in one
    send, with the write that brings them to ``HOLD_BYTES`` or when the answer is
    complete (``flush``). A small answer is then one segment, read by the client in one
    wake-up; a large binary answer (head, array header, the array's memory) one
    ``writev``. Writes that do not complete the answer within the same turn of the
    event loop (an event stream's first event, say) go out at the end of that turn;
    later ones go straight through."""

    __slots__ = ("_held", "_held_bytes", "_loop", "_started", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
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
            self._transport.write(data)
            return
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

    def then(self, on_response: Callable[[], None]) -> Callable[[], None]:
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


def _framing(headers: list[tuple[bytes, bytes]]) -> tuple[int, bool]:
    """``(Content-Length, whether X-Forwarded-For or -Proto is present)``; the length
    is -1 without one, for a chunked body, or one repeated or not a plain number (left
    to uvicorn and the application)."""
    length, forwarded = -1, False
    for name, value in headers:
        if name == b"content-length":
            if length >= 0 or not value.isdigit() or len(value) > 18:
                return -1, forwarded
            length = int(value)
        elif name == b"transfer-encoding":
            return -1, forwarded
        elif name == b"x-forwarded-for" or name == b"x-forwarded-proto":
            forwarded = True
    return length, forwarded


class _Reader(asyncio.BufferedProtocol):
    """What the event loop reads one connection into, in front of its HTTP protocol.

    * A request's head (and a small body) is read into the thread's read buffer, at
      most ``HEAD_READ_BYTES`` at a time until the head is in and ``READ_BYTES`` after,
      and handed on to the protocol's ``data_received`` as one ``bytes`` per read, as
      the event loop would (uvloop reads 256 KiB at a time). A large body's first read
      then holds little more than its head, so the application starts, and takes the
      body, while the rest is still arriving.
    * While a large body arrives (``receive_into``), the event loop reads into the
      body's own buffer itself, instead of into its own buffer, then a ``bytes`` per
      read, then the parser's ``bytes`` per body chunk, then the buffer (three copies
      less per byte). ``get_buffer`` offers only what is left of the body, so nothing
      past it (a pipelined request) is read there. When the last byte is in, the
      protocol gets a fresh parser, as the old one would be after this message.

    A disconnect, the end of input and write flow control are passed on as they come.
    """

    def __init__(self, protocol: Any) -> None:
        self.protocol = protocol
        self.reads = _read_buffer()  # made in the event loop's thread, as it is used
        self.head_reads = self.reads[:HEAD_READ_BYTES]
        self.view: memoryview | None = None  # the body being received, if any
        self.got = 0

    def receive_into(self, inbox: Any, got: int) -> None:
        """Read the rest of the current body into ``inbox`` (``got`` bytes are in)."""
        self.view, self.got = memoryview(inbox), got
        log.debug("receiving %d body bytes into one buffer", len(inbox) - got)

    def get_buffer(self, sizehint: int) -> memoryview:
        view = self.view
        if view is not None:
            return view[self.got :]
        return self.head_reads if self.protocol._phase in (_HEAD, _IDLE) else self.reads

    def buffer_updated(self, nbytes: int) -> None:
        protocol = self.protocol
        if self.view is None:
            protocol.data_received(self.reads[:nbytes].tobytes())
            return
        self.got += nbytes
        protocol._inbox_got = self.got
        if self.got < len(self.view):
            return
        self.view = None
        # uvicorn's parser: the state it would be in after this message
        protocol.parser = httptools.HttpRequestParser(protocol)
        try:
            protocol.parser.set_dangerous_leniencies(lenient_data_after_close=True)
        except AttributeError:  # pragma: no cover - httptools < 0.6.3
            pass
        protocol.on_message_complete()

    def eof_received(self) -> bool | None:
        return self.protocol.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.protocol.connection_lost(exc)

    def pause_writing(self) -> None:
        self.protocol.pause_writing()

    def resume_writing(self) -> None:
        self.protocol.resume_writing()


def aligned_buffer(size: int, align: int = 64) -> memoryview:
    """A writable ``size``-byte buffer whose first byte is ``align``-byte aligned.

    Not zeroed (a body is received into all of it before it is read): a ``bytearray``
    would write every byte once more, 8 MB at n = 10^6."""
    raw = np.empty(size + align - 1, np.uint8)
    start = -raw.ctypes.data % align
    return memoryview(raw)[start:start + size]


def _is_binary(headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether the request's Content-Type is the binary framing."""
    return any(
        name == b"content-type" and _BINARY_TYPE in value.lower() for name, value in headers
    )


def _inbox_receive(protocol: Any, cycle: Any, length: int, binary: bool = False) -> Any:
    """An ASGI ``receive`` for ``cycle`` (a body of ``length`` bytes) that delivers the
    body whole, received into one buffer.

    The first call allocates the buffer (unless the body is in already), waits until
    the last byte is in (or the client is gone) and returns the body as one
    ``http.request`` message (a ``bytearray``: bytes-like, not copied); later calls are
    uvicorn's own (they wait for a disconnect).
    """
    delivered = False
    own_receive = type(cycle).receive

    async def receive() -> dict:
        nonlocal delivered
        if delivered or not cycle.more_body or cycle.disconnected or cycle.response_complete:
            return await own_receive(cycle)  # in already (or gone): uvicorn's way
        delivered = True
        inbox = _open_inbox(protocol, cycle, length, binary, cycle.body)
        cycle.body = bytearray()
        if cycle.waiting_for_100_continue and not cycle.transport.is_closing():
            cycle.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            cycle.waiting_for_100_continue = False
        while cycle.more_body and not cycle.disconnected and not cycle.response_complete:
            cycle.flow.resume_reading()
            await cycle.message_event.wait()
            cycle.message_event.clear()
        _close_inbox(protocol, inbox)
        if cycle.disconnected or cycle.response_complete:
            return {"type": "http.disconnect"}
        return {"type": "http.request", "body": inbox, "more_body": False}

    return receive


def _open_inbox(protocol: Any, cycle: Any, length: int, binary: bool, received: Any) -> Any:
    """One buffer for ``cycle``'s body of ``length`` bytes, with ``received`` (what is
    in already) copied in; the rest is read straight into it (``_Reader``), or copied in
    by ``on_body`` a read at a time."""
    # a binary body's arrays sit at 64-byte offsets in it: in a 64-byte aligned
    # buffer, the device can use their bytes as they are instead of copying them
    inbox = aligned_buffer(length) if binary else bytearray(length)
    got = len(received)
    inbox[:got] = received
    protocol._inbox, protocol._inbox_got, protocol._inbox_cycle = inbox, got, cycle
    reader = protocol._reader
    if (  # the rest straight from the socket
        protocol.cycle is cycle and got < length and reader is not None
        and not protocol.transport.is_closing()
    ):
        reader.receive_into(inbox, got)
    return inbox


def _close_inbox(protocol: Any, inbox: Any) -> None:
    """The body is in, or its client gone: ``inbox`` takes no more bytes."""
    if protocol._inbox is inbox:  # gone before the last byte: drop it
        protocol._inbox = protocol._inbox_cycle = None
