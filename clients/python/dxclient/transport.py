"""The clients' fast path: operator calls over kept-alive sockets, their HTTP by h11.

Through ``httpx.Client.send`` a gradient call at 10^5 values cost ~1,850 Python calls on the
client (httpx's request, auth, redirect and cookie steps, a transport's pool, header parsing,
a joined body). ``FastPath`` sends an operator call itself: h11 writes the request's head
and parses the answer's; the body goes out as its parts (``socket.sendmsg``, never joined);
a ``Content-Length`` body is read with ``recv_into`` into one buffer made for it (any other
body, h11 reads). Sockets are kept alive per host; ``send`` blocks, ``asend`` runs on asyncio.

It takes a call only while nothing httpx does per request could change it or its answer:
plain ``http``, the httpx client open, no auth (nor credentials in the URL), no event
hooks, no query parameters, no cookies in the jar, no redirects followed; otherwise it
returns None and the call goes through httpx. The head holds what httpx would send (built
once per path and header set by ``build_request``: the client's headers, a token among
them). An answer that sets a cookie or is content-encoded becomes an ``httpx.Response``,
so httpx stores the cookie and decodes the body. Calls log as httpx logs them; errors are
httpx's (``ConnectError``, ``ReadTimeout``, ``RemoteProtocolError``, ...) with their
request, so the clients' retry rules hold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import time
from collections.abc import Generator, Mapping, Sequence
from typing import Any

import h11
import httpx

#: seconds an idle connection is kept: under the server's own keep-alive timeout (uvicorn's
#: and dxserve's default, 5 s, counts from a little earlier than ours)
KEEPALIVE_EXPIRY = 4.0
MAX_IDLE_PER_HOST = 16
#: answer headers that need httpx: a cookie to store, a body to decode
TO_HTTPX = (b"set-cookie", b"content-encoding")
_RECV = 64 * 1024
#: most buffers one ``sendmsg`` takes (Linux: 1024; more fails with EMSGSIZE)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_log = logging.getLogger("httpx")  # httpx logs each request at INFO under its name
#: what one step of an exchange asks: (write?, views to send / a view to fill / None)
Step = tuple[bool, Any]


class Answer:
    """An answer read by the fast path: ``status_code``, ``headers`` (``httpx.Headers``),
    ``content`` (a bytearray)."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: httpx.Headers, content: Any) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content


def _exchange(
    h: h11.Connection, head: bytes, parts: Sequence[Any], method: str
) -> Generator[Step, Any, tuple]:
    """One exchange without I/O. Yields ``(True, views)`` (sent back: bytes sent),
    ``(False, None)`` (sent back: bytes received for h11, b"" at the end) or ``(False,
    view)`` (sent back: bytes received into it); returns ``(h11.Response, body: bytearray,
    keep the connection)``."""
    views = [v for v in (memoryview(head), *(memoryview(p).cast("B") for p in parts)) if v]
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
    event = h.next_event()
    while not isinstance(event, h11.Response):  # 1xx answers skipped
        if event is h11.NEED_DATA:
            h.receive_data((yield False, None))
        event = h.next_event()
    values = [v for n, v in event.headers if n == b"content-length"]
    if (
        method == "HEAD"
        or event.status_code in (204, 304)
        or len(values) != 1
        or any(n == b"transfer-encoding" for n, _ in event.headers)
    ):
        chunks = []  # no body, chunked or read to the close: h11 reads it
        while not isinstance(got := h.next_event(), h11.EndOfMessage | h11.ConnectionClosed):
            if got is h11.NEED_DATA:
                h.receive_data((yield False, None))
            elif isinstance(got, h11.Data):
                chunks.append(got.data)
        return event, bytearray(b"".join(chunks)), False
    length, early = int(values[0]), h.trailing_data[0]  # the body's bytes h11 holds
    body = bytearray(length)
    view, got = memoryview(body), min(len(early), length)
    view[:got] = early[:got]
    while got < length:
        n = yield False, view[got:]
        if not n:
            raise h11.RemoteProtocolError(
                "peer closed connection without sending complete "
                f"message body: received {got} bytes, expected {length}"
            )
        got += n
    # h11's rule for keeping a connection: HTTP/1.1 and no "Connection: close"
    keep = (
        len(early) <= length
        and event.http_version == b"1.1"
        and not any(n == b"connection" and b"close" in v.lower() for n, v in event.headers)
    )
    return event, body, keep


def _error(exc: BaseException, writing: bool) -> BaseException:
    """httpx's error for what the socket or h11 raised (``exc`` itself for others)."""
    if isinstance(exc, h11.RemoteProtocolError):
        kind: type[httpx.TransportError] = httpx.RemoteProtocolError
    elif isinstance(exc, TimeoutError):
        kind = httpx.WriteTimeout if writing else httpx.ReadTimeout
    elif isinstance(exc, OSError):
        kind = httpx.WriteError if writing else httpx.ReadError
    else:
        return exc
    return kind(str(exc) or type(exc).__name__)


def _io(sock: socket.socket, write: bool, arg: Any) -> Any:
    return sock.sendmsg(arg) if write else sock.recv(_RECV) if arg is None else sock.recv_into(arg)


def _run(sock: socket.socket, steps: Generator[Step, Any, tuple], t: httpx.Timeout) -> tuple:
    """Drive ``steps`` on a blocking socket; its result."""
    step, mode = next(steps), None
    while True:
        write = step[0]
        try:
            if write is not mode:  # a timeout per direction, set as it changes
                mode = write
                sock.settimeout(t.write if write else t.read)
            done = _io(sock, *step)
        except (BrokenPipeError, ConnectionResetError) as exc:
            if not write:
                raise _error(exc, False) from exc
            step = steps.throw(exc)
            continue
        except OSError as exc:
            raise _error(exc, write) from exc
        try:
            step = steps.send(done)
        except StopIteration as end:
            return end.value


async def _arun(
    loop: asyncio.AbstractEventLoop,
    sock: socket.socket,
    steps: Generator[Step, Any, tuple],
    t: httpx.Timeout,
) -> tuple:
    """Drive ``steps`` on a non-blocking socket, watched only while it has nothing to read
    (or no room to write): a timeout counts from the last bytes that moved."""
    step = next(steps)
    while True:
        write = step[0]
        try:
            done = _io(sock, *step)
        except BlockingIOError:
            ready, fd = loop.create_future(), sock.fileno()
            (loop.add_writer if write else loop.add_reader)(fd, _wake, ready)
            try:
                await _within(ready, t.write if write else t.read)
            except TimeoutError as exc:
                raise _error(exc, write) from exc
            finally:  # nothing stays watched, cancelled or not
                (loop.remove_writer if write else loop.remove_reader)(fd)
            continue
        except (BrokenPipeError, ConnectionResetError) as exc:
            if not write:
                raise _error(exc, False) from exc
            step = steps.throw(exc)
            continue
        except OSError as exc:
            raise _error(exc, write) from exc
        try:
            step = steps.send(done)
        except StopIteration as end:
            return end.value


def _wake(ready: asyncio.Future) -> None:
    if not ready.done():
        ready.set_result(None)


async def _within(awaitable: Any, seconds: float | None) -> Any:
    """``await awaitable``; TimeoutError after ``seconds`` (None: no limit). A timeout
    scope where asyncio has one (3.11+): no task, as ``wait_for`` makes."""
    if seconds is None:
        return await awaitable
    if not hasattr(asyncio, "timeout"):
        return await asyncio.wait_for(awaitable, seconds)
    async with asyncio.timeout(seconds):
        return await awaitable


class FastPath:
    """Operator calls of one httpx client (``Client``'s: ``send``; ``AsyncClient``'s:
    ``asend``) over its own kept-alive sockets. ``requests``: how many it sent."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._heads: dict[tuple, list] = {}
        self._client_headers: list = []
        self.requests = 0

    def _start(
        self,
        http: Any,
        method: str,
        url: httpx.URL,
        headers: Mapping[str, str],
        parts: Sequence[Any],
        size: int,
    ) -> Generator[Step, Any, tuple] | None:
        """The exchange's steps, or None where httpx must send the call."""
        if (
            url.scheme != "http"
            or url.userinfo
            or http.is_closed
            or http.auth is not None
            or http.follow_redirects
            or http.params
            or any(http.event_hooks.values())
            or len(http.cookies.jar)
        ):
            return None
        if http.headers.raw != self._client_headers:  # a new token, say: heads anew
            self._client_headers, self._heads = http.headers.raw, {}
        key = (method, url, *headers.items())
        kept = self._heads.get(key)
        if kept is None:
            built = http.build_request(method, url, headers=headers).headers.raw
            kept = [(n, v) for n, v in built if n.lower() != b"content-length"]
            self._heads = {**self._heads, key: kept} if len(self._heads) < 256 else {key: kept}
        h = h11.Connection(h11.CLIENT)  # one per exchange: the answer's body is read here
        head = h.send(
            h11.Request(
                method=method,
                target=url.raw_path,
                headers=[*kept, (b"content-length", b"%d" % size)],
            )
        )
        return _exchange(h, head, parts, method)

    def _checkout(self, address: tuple[str, int]) -> socket.socket | None:
        idle, now = self._idle.get(address), time.monotonic()
        while idle:
            sock, since = idle.pop()
            try:  # readable while idle: the server closed it
                if now - since < KEEPALIVE_EXPIRY and not select.select([sock], [], [], 0)[0]:
                    return sock
            except (OSError, ValueError):
                pass
            sock.close()
        return None

    def _finish(
        self,
        http: Any,
        method: str,
        url: httpx.URL,
        address: tuple[str, int],
        sock: socket.socket,
        result: tuple,
    ) -> Answer | httpx.Response:
        event, body, keep = result
        idle = self._idle.setdefault(address, [])
        if keep and len(idle) < MAX_IDLE_PER_HOST:
            idle.append((sock, time.monotonic()))
        else:
            sock.close()
        self.requests += 1
        if _log.isEnabledFor(logging.INFO):
            _log.info(
                'HTTP Request: %s %s "HTTP/1.1 %d %s"',
                method,
                url,
                event.status_code,
                event.reason.decode("ascii", "replace"),
            )
        raw = event.headers.raw_items()
        if not any(n.lower() in TO_HTTPX for n, _ in raw):
            return Answer(event.status_code, httpx.Headers(raw), body)
        response = httpx.Response(
            event.status_code,
            headers=raw,
            stream=httpx.ByteStream(bytes(body)),
            request=http.build_request(method, url),
        )
        response.read()  # decoded as httpx decodes it
        http.cookies.extract_cookies(response)
        return response

    @staticmethod
    def _failed(
        exc: BaseException, sock: socket.socket | None, http: Any, method: str, url: httpx.URL
    ) -> BaseException:
        if sock is not None:  # never kept after an error, a cancellation included
            sock.close()
        if isinstance(exc, h11.RemoteProtocolError):
            exc = _error(exc, False)
        if isinstance(exc, httpx.TransportError):
            exc.request = http.build_request(method, url)
        return exc

    def send(
        self,
        http: httpx.Client,
        method: str,
        url: httpx.URL,
        headers: Mapping[str, str],
        parts: Sequence[Any],
        size: int,
    ) -> Answer | httpx.Response | None:
        """``method`` ``url`` with ``headers`` and the body ``parts`` (``size`` bytes in
        all) sent and its answer read; None: send it through ``http`` instead."""
        steps = self._start(http, method, url, headers, parts, size)
        if steps is None:
            return None
        address, t = (url.host, url.port or 80), http.timeout
        sock = self._checkout(address)
        try:
            if sock is None:
                try:
                    sock = socket.create_connection(address, timeout=t.connect)
                except TimeoutError as exc:
                    raise httpx.ConnectTimeout(str(exc) or "connect timed out") from exc
                except OSError as exc:
                    raise httpx.ConnectError(str(exc)) from exc
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            result = _run(sock, steps, t)
        except BaseException as exc:
            error = self._failed(exc, sock, http, method, url)
            if error is exc:
                raise
            raise error from exc
        return self._finish(http, method, url, address, sock, result)

    async def asend(
        self,
        http: httpx.AsyncClient,
        method: str,
        url: httpx.URL,
        headers: Mapping[str, str],
        parts: Sequence[Any],
        size: int,
    ) -> Answer | httpx.Response | None:
        """``send`` for an ``httpx.AsyncClient``, on asyncio (else None)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio, say: httpx's own transport serves it
            return None
        steps = self._start(http, method, url, headers, parts, size)
        if steps is None:
            return None
        address, t = (url.host, url.port or 80), http.timeout
        sock = self._checkout(address)
        try:
            if sock is None:
                try:
                    info = await _within(
                        loop.getaddrinfo(*address, type=socket.SOCK_STREAM), t.connect
                    )
                    sock = socket.socket(*info[0][:3])
                    sock.setblocking(False)
                    await _within(loop.sock_connect(sock, info[0][4]), t.connect)
                except TimeoutError as exc:
                    raise httpx.ConnectTimeout("connect timed out") from exc
                except OSError as exc:
                    raise httpx.ConnectError(str(exc)) from exc
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            result = await _arun(loop, sock, steps, t)
        except BaseException as exc:
            error = self._failed(exc, sock, http, method, url)
            if error is exc:
                raise
            raise error from exc
        return self._finish(http, method, url, address, sock, result)

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for sock, _ in conns:
                sock.close()
