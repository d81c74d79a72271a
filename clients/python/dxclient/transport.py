"""The clients' fast path: operator calls over kept-alive sockets, their HTTP by h11.

Through ``httpx.Client.send`` a gradient call at 10^5 values cost ~1,850 Python calls. Here the
body goes out in its parts (``sendmsg``) and comes back by ``recv_into`` into one buffer; calls
httpx would change (auth, hooks, params, cookies, redirects, not plain http) go through httpx.
"""

from __future__ import annotations

import asyncio
import logging
import select
import socket
import time
from collections import namedtuple
from collections.abc import Generator, Mapping, Sequence
from contextlib import suppress
from typing import Any, NoReturn

import h11
import httpx

from ._buffers import AnswerBuffers

KEEPALIVE_EXPIRY = 4.0  # seconds idle: under the server's 5 s, which starts a little earlier
MAX_IDLE_PER_HOST = 16
TO_HTTPX = (b"set-cookie", b"content-encoding")  # answers httpx reads: a cookie, an encoding
_RECV = 16 * 1024  # the head and a first piece: the rest of a body goes by recv_into
IOV_MAX = 1024  # most buffers one sendmsg takes on Linux (more: EMSGSIZE)
_log = logging.getLogger("httpx")  # httpx logs each request at INFO under its name:
_LOGGED = 'HTTP Request: %s %s "HTTP/1.1 %d %s"'
Step = tuple[bool, Any]  # (write?, views to send / a view to fill / None: bytes for h11)
Steps = Generator[Step, Any, tuple]
_WAIT = object()  # a non-blocking socket is not ready
Answer = namedtuple("Answer", "status_code headers content")  # httpx.Headers, bytearray


def _until(h: h11.Connection, kind: Any, chunks: list | None = None) -> Steps:
    """h11's events up to the first of ``kind`` (returned); the data of others kept in chunks."""
    while not isinstance(event := h.next_event(), kind):
        if event is h11.NEED_DATA:
            h.receive_data((yield False, None))
        elif chunks is not None and isinstance(event, h11.Data):
            chunks.append(event.data)
    return event


def _exchange(h: h11.Connection, views: list[memoryview], method: str, take: Any) -> Steps:
    """One exchange without I/O: yields ``(True, views)`` to send, ``(False, None)`` for bytes
    to h11 or ``(False, view)`` to fill (``take(n)``'s); returns ``(h11.Response, body, keep)``."""
    try:
        while views:
            sent = yield True, views[:IOV_MAX]
            while sent:
                if sent >= views[0].nbytes:
                    sent -= views.pop(0).nbytes
                else:
                    views[0], sent = views[0][sent:], 0
    except (BrokenPipeError, ConnectionResetError):
        pass  # perhaps answered early (413) and closed: read the answer
    event = yield from _until(h, h11.Response)  # 1xx answers skipped
    fields = event.headers
    values = [v for n, v in fields if n == b"content-length"]
    if (method == "HEAD" or event.status_code in (204, 304) or len(values) != 1
            or any(n == b"transfer-encoding" for n, _ in fields)):  # fmt: skip
        chunks: list = []  # no body, chunked or read to the close: h11 reads it
        yield from _until(h, h11.EndOfMessage | h11.ConnectionClosed, chunks)
        return event, bytearray(b"".join(chunks)), False
    length, early = int(values[0]), h.trailing_data[0]  # the body's bytes h11 holds
    view, got = memoryview(body := take(length)), min(len(early), length)
    view[:got] = early[:got]
    while got < length:
        n = yield False, view[got:]
        if not n:  # closed early: h11 says so ("peer closed connection without ...")
            h.receive_data(b"")
            while True:
                h.next_event()
        got += n
    closes = any(n == b"connection" and b"close" in v.lower() for n, v in fields)
    return event, body, len(early) <= length and event.http_version == b"1.1" and not closes


def _error(exc: BaseException, writing: bool) -> BaseException:
    """httpx's error for what the socket or h11 raised (``exc`` itself for others)."""
    if isinstance(exc, h11.RemoteProtocolError):
        return httpx.RemoteProtocolError(str(exc))
    if isinstance(exc, TimeoutError):
        return (httpx.WriteTimeout if writing else httpx.ReadTimeout)(str(exc) or "timed out")
    if isinstance(exc, OSError):
        return (httpx.WriteError if writing else httpx.ReadError)(str(exc) or type(exc).__name__)
    return exc


def _next(steps: Steps, sock: socket.socket, step: Step) -> tuple[Step | None, Any]:
    """One step's I/O: ``(next step, None)``, ``(None, result)`` or ``(step, _WAIT)``."""
    write, v = step
    try:
        done = sock.sendmsg(v) if write else sock.recv(_RECV) if v is None else sock.recv_into(v)
    except BlockingIOError:
        return step, _WAIT
    except OSError as exc:
        if write and isinstance(exc, BrokenPipeError | ConnectionResetError):
            return steps.throw(exc), None  # perhaps answered early: read the answer
        raise _error(exc, write) from exc
    try:
        return steps.send(done), None
    except StopIteration as end:
        return None, end.value


async def _arun(loop: Any, sock: socket.socket, steps: Steps, t: httpx.Timeout) -> tuple:
    """Drive ``steps`` on a non-blocking socket, watched only while not ready (and never after)."""
    step: Step | None = next(steps)
    while True:
        step, result = _next(steps, sock, step)  # type: ignore[arg-type]
        if step is None:
            return result
        if result is not _WAIT:
            continue
        write, ready, fd = step[0], loop.create_future(), sock.fileno()
        timeout, late = (t.write if write else t.read), _error(TimeoutError(), write)
        timer = None if timeout is None else loop.call_later(timeout, _wake, ready, late)
        (loop.add_writer if write else loop.add_reader)(fd, _wake, ready, None)
        try:
            await ready
        finally:
            (loop.remove_writer if write else loop.remove_reader)(fd)
            if timer is not None:
                timer.cancel()


def _connect(address: tuple[str, int], timeout: float | None) -> socket.socket:
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except OSError as exc:
        kind = httpx.ConnectTimeout if isinstance(exc, TimeoutError) else httpx.ConnectError
        raise kind(str(exc) or kind.__name__) from exc
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _wake(ready: asyncio.Future, error: BaseException | None) -> None:
    """The socket is ready (no ``error``), or its timeout passed."""
    if not ready.done():
        ready.set_result(None) if error is None else ready.set_exception(error)


class FastPath:
    """Operator calls of httpx clients (``Client``'s: ``send``; ``AsyncClient``'s: ``asend``)
    over its own kept-alive sockets. ``requests``: how many it sent."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._heads: dict[tuple, bytes] = {}
        self.buffers = AnswerBuffers()  # large answers' memory, reused once free
        self.requests = 0

    def _start(self, http: Any, method: str, url: httpx.URL, headers: Mapping, parts: Sequence):
        """``(steps, address, kept-alive socket or None)``; None where httpx must send it."""
        if (url.scheme != "http" or url.userinfo or http.is_closed or http.auth is not None
                or http.follow_redirects or http.params or any(http.event_hooks.values())
                or len(http.cookies.jar)):  # fmt: skip
            return None
        views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]
        key = (method, url, sum(v.nbytes for v in views), *headers.items(), *http.headers.raw)
        if (head := self._heads.get(key)) is None:  # h11 writes it once per path, size, headers
            sized = {**headers, "content-length": str(key[2])}
            fields = http.build_request(method, url, headers=sized).headers.raw
            request = h11.Request(method=method, target=url.raw_path, headers=fields)
            head = h11.Connection(h11.CLIENT).send(request)
            self._heads = {**self._heads, key: head} if len(self._heads) < 256 else {key: head}
        # a fresh h11 state per answer: the body is read here, h11's state can't go on
        h = h11.Connection(h11.CLIENT)
        steps = _exchange(h, [memoryview(head), *views], method, self.buffers.take)
        return steps, (address := (url.host, url.port or 80)), self._checkout(address)

    def _checkout(self, address: tuple[str, int]) -> socket.socket | None:
        idle, now = self._idle.get(address), time.monotonic()
        while idle:
            sock, since = idle.pop()
            with suppress(OSError, ValueError):  # readable while idle: the server closed it
                if now - since < KEEPALIVE_EXPIRY and not select.select([sock], [], [], 0)[0]:
                    return sock
            sock.close()

    def _finish(self, http: Any, method: str, url: httpx.URL, address: tuple, sock: Any, result):
        event, body, keep = result
        idle = self._idle.setdefault(address, [])
        if keep and len(idle) < MAX_IDLE_PER_HOST:
            idle.append((sock, time.monotonic()))
        else:
            sock.close()
        self.requests += 1
        _log.info(_LOGGED, method, url, event.status_code, event.reason.decode("latin-1"))
        raw = event.headers.raw_items()
        if not any(n.lower() in TO_HTTPX for n, _ in raw):
            return Answer(event.status_code, httpx.Headers(raw), body)
        request, stream = http.build_request(method, url), httpx.ByteStream(bytes(body))
        response = httpx.Response(event.status_code, headers=raw, stream=stream, request=request)
        response.read()  # decoded as httpx decodes it
        http.cookies.extract_cookies(response)
        return response

    @staticmethod
    def _fail(exc: BaseException, sock: Any, http: Any, method: str, url: httpx.URL) -> NoReturn:
        """Raise httpx's error for ``exc``, with its request; the socket closed."""
        if sock is not None:  # never kept after an error, a cancellation included
            sock.close()
        error = _error(exc, False)  # socket errors came mapped; h11's, not yet
        if isinstance(error, httpx.TransportError):
            error.request = http.build_request(method, url)
        raise error from (exc.__cause__ if error is exc else exc)

    def send(self, http: httpx.Client, method: str, url: httpx.URL, headers: Mapping, parts: Any):
        """``method`` ``url`` with ``headers`` and the body ``parts`` (bytes-like, in order)
        sent and its answer read: an ``Answer`` or ``httpx.Response``; None: httpx sends it."""
        if (started := self._start(http, method, url, headers, parts)) is None:
            return None
        (steps, address, sock), t, result = started, http.timeout, None
        try:  # driven on a blocking socket, a timeout per step's direction
            sock, step = sock or _connect(address, t.connect), next(steps)
            while step is not None:
                sock.settimeout(t.write if step[0] else t.read)
                step, result = _next(steps, sock, step)
        except BaseException as exc:
            self._fail(exc, sock, http, method, url)
        return self._finish(http, method, url, address, sock, result)

    async def asend(self, http: httpx.AsyncClient, method: str, url: httpx.URL, headers, parts):
        """``send`` for an ``httpx.AsyncClient``, on asyncio (else None: httpx sends it)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio, say: httpx's own transport serves it
            return None
        if (started := self._start(http, method, url, headers, parts)) is None:
            return None
        (steps, address, sock), t = started, http.timeout
        try:
            if sock is None:  # in a thread: the name's lookup blocks
                sock = await loop.run_in_executor(None, _connect, address, t.connect)
                sock.setblocking(False)
            result = await _arun(loop, sock, steps, t)
        except BaseException as exc:
            self._fail(exc, sock, http, method, url)
        return self._finish(http, method, url, address, sock, result)

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for sock, _ in (kept for conns in idle.values() for kept in conns):
            sock.close()
