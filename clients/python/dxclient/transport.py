"""The clients' fast path: operator calls over kept-alive sockets, HTTP written and read by h11.

Through ``httpx.Client.send`` a gradient call at 10^5 values costs ~1,800 Python calls on
the client: httpx's request, auth, redirect and cookie steps, a transport's pool, header
parsing, and answers read in 64 KiB pieces joined at the end. ``FastPath`` sends an
operator call itself, over public APIs only: h11 writes the request head and parses the
answer's head; the body goes out as its parts (``socket.sendmsg``, never joined), and a
``Content-Length`` answer is read with ``recv_into`` into one buffer allocated for it.
Sockets are kept alive per host and port; ``Client`` uses the blocking twin, ``AsyncClient``
(on asyncio) the async one.

It takes a call only while nothing httpx does per request could change it or what becomes
of its answer: plain ``http``, the httpx client open, no auth (nor credentials in the URL),
no event hooks, no query parameters, no cookies in the jar, no redirects followed.
Otherwise ``send`` returns None and the call goes through httpx. The head holds what httpx
would send (built once per path and header set with ``Client.build_request``: the client's
headers, a token among them). An answer that sets a cookie or is content-encoded becomes
an ``httpx.Response`` after all, so httpx stores the cookie and decodes the body; calls log
as httpx logs them; errors are httpx's (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
``WriteError``, ``RemoteProtocolError``, ...) with their request, so retry rules hold.
"""

from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
import time
from collections.abc import Mapping, Sequence
from typing import Any

import h11
import httpx

#: seconds an idle connection is kept: under the server's own keep-alive timeout (uvicorn's
#: and dxserve's default, 5 s, counts from a little earlier than ours)
KEEPALIVE_EXPIRY = 4.0
#: kept-alive connections per host
MAX_IDLE_PER_HOST = 16
#: answer headers that need httpx: a cookie to store, a body to decode
TO_HTTPX = (b"set-cookie", b"content-encoding")
_RECV = 64 * 1024
#: most buffers one ``sendmsg`` takes (Linux: 1024; more fails with EMSGSIZE)
IOV_MAX = min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024, 1024)
_log = logging.getLogger("httpx")  # httpx logs each request at INFO under its name


class Answer:
    """An answer read by the fast path: ``status_code``, ``headers`` (``httpx.Headers``),
    ``content`` (a bytearray)."""

    __slots__ = ("content", "headers", "status_code")

    def __init__(self, status_code: int, headers: httpx.Headers, content: Any) -> None:
        self.status_code, self.headers, self.content = status_code, headers, content


def _exchange_start(method: str, url: httpx.URL, headers: list) -> tuple[h11.Connection, bytes]:
    """A fresh h11 state for one request, and the request's head as h11 writes it."""
    h = h11.Connection(h11.CLIENT)
    return h, h.send(h11.Request(method=method, target=url.raw_path, headers=headers))


def _length(method: str, head: h11.Response) -> int | None:
    """The answer's body length if it is read into one buffer here; None: h11 reads it."""
    if method == "HEAD" or head.status_code in (204, 304):
        return None
    values = [v for n, v in head.headers if n == b"content-length"]
    chunked = any(n == b"transfer-encoding" for n, _ in head.headers)
    return int(values[0]) if len(values) == 1 and not chunked else None


def _keeps(head: h11.Response) -> bool:
    """h11's own rule: HTTP/1.1 and no ``Connection: close``."""
    return head.http_version == b"1.1" and not any(
        n == b"connection" and b"close" in v.lower() for n, v in head.headers
    )


def _views(head: bytes, parts: Sequence[Any]) -> list[memoryview]:
    """The request's bytes as views, empty parts left out (``sendmsg`` would send 0)."""
    views = [memoryview(head), *(memoryview(p).cast("B") for p in parts)]
    return [v for v in views if v.nbytes]


def _unsent(views: list[memoryview], sent: int) -> list[memoryview]:
    while sent and views:
        if sent >= views[0].nbytes:
            sent -= views.pop(0).nbytes
        else:
            views[0], sent = views[0][sent:], 0
    return views


def _error(exc: BaseException, request: httpx.Request, writing: bool) -> BaseException:
    """httpx's error for what the socket or h11 raised."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, httpx.TransportError):
        exc.request = request
        return exc
    if isinstance(exc, h11.RemoteProtocolError):
        kind: type[httpx.TransportError] = httpx.RemoteProtocolError
    elif isinstance(exc, TimeoutError):
        kind = httpx.WriteTimeout if writing else httpx.ReadTimeout
    elif isinstance(exc, OSError):
        kind = httpx.WriteError if writing else httpx.ReadError
    else:
        return exc
    return kind(text, request=request)


_CUT = "peer closed connection without sending complete message body"


class FastPath:
    """Operator calls of one httpx client (``Client``'s: ``send``; ``AsyncClient``'s:
    ``asend``) over its own kept-alive sockets. ``requests``: how many it sent."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[tuple[socket.socket, float]]] = {}
        self._heads: dict[tuple, list] = {}
        self._client_headers: list = []
        self.requests = 0

    def _headers(self, http: Any, method: str, url: httpx.URL, headers: Mapping[str, str],
                 size: int) -> list | None:
        """The request's header list, or None where httpx must send it."""
        if (url.scheme != "http" or url.userinfo or http.is_closed or http.auth is not None
                or http.follow_redirects or http.params or any(http.event_hooks.values())
                or len(http.cookies.jar)):
            return None
        if http.headers.raw != self._client_headers:  # a new token, say: heads anew
            self._client_headers, self._heads = http.headers.raw, {}
        key = (method, url, *headers.items())
        kept = self._heads.get(key)
        if kept is None:
            built = http.build_request(method, url, headers=headers).headers.raw
            kept = [(n, v) for n, v in built if n.lower() not in (b"content-length",
                                                                  b"transfer-encoding")]
            self._heads = {**self._heads, key: kept} if len(self._heads) < 256 else {key: kept}
        return [*kept, (b"content-length", b"%d" % size)]

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

    def _checkin(self, address: tuple[str, int], sock: socket.socket, keep: bool) -> None:
        idle = self._idle.setdefault(address, [])
        if keep and len(idle) < MAX_IDLE_PER_HOST:
            idle.append((sock, time.monotonic()))
        else:
            sock.close()

    def _answer(self, http: Any, method: str, url: httpx.URL, head: h11.Response,
                body: Any) -> Answer | httpx.Response:
        self.requests += 1
        if _log.isEnabledFor(logging.INFO):
            _log.info('HTTP Request: %s %s "HTTP/1.1 %d %s"', method, url, head.status_code,
                      head.reason.decode("ascii", "replace"))
        raw = head.headers.raw_items()
        if not any(n.lower() in TO_HTTPX for n, _ in raw):
            return Answer(head.status_code, httpx.Headers(raw), body)
        response = httpx.Response(head.status_code, headers=raw, request=http.build_request(
            method, url), stream=httpx.ByteStream(bytes(body)))
        response.read()  # decoded as httpx decodes it
        http.cookies.extract_cookies(response)
        return response

    # --- blocking ------------------------------------------------------------------
    def send(self, http: httpx.Client, method: str, url: httpx.URL, headers: Mapping[str, str],
             parts: Sequence[Any], size: int) -> Answer | httpx.Response | None:
        """``method`` ``url`` with ``headers`` and the body ``parts`` (``size`` bytes in
        all) sent and its answer read; None: send it through ``http`` instead."""
        fields = self._headers(http, method, url, headers, size)
        if fields is None:
            return None
        address, t = (url.host, url.port or 80), http.timeout
        h, request_head = _exchange_start(method, url, fields)
        sock, writing = self._checkout(address), True
        try:
            if sock is None:
                try:
                    sock = socket.create_connection(address, timeout=t.connect)
                except TimeoutError as exc:
                    raise httpx.ConnectTimeout(str(exc) or "connect timed out") from exc
                except OSError as exc:
                    raise httpx.ConnectError(str(exc)) from exc
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(t.write)
            views = _views(request_head, parts)
            try:
                while views:
                    views = _unsent(views, sock.sendmsg(views[:IOV_MAX]))
            except OSError as exc:  # perhaps answered early (413) and closed: read it
                if isinstance(exc, TimeoutError):
                    raise
            writing = False
            sock.settimeout(t.read)
            event = h.next_event()
            while not isinstance(event, h11.Response):
                if event is h11.NEED_DATA:
                    h.receive_data(sock.recv(_RECV))
                event = h.next_event()
            length = _length(method, event)
            if length is None:  # no body, chunked or read to the close: h11 reads it
                chunks = []
                while (got := h.next_event()) is not h11.PAUSED and not isinstance(
                        got, h11.EndOfMessage):
                    if got is h11.NEED_DATA:
                        h.receive_data(sock.recv(_RECV))
                    elif isinstance(got, h11.Data):
                        chunks.append(got.data)
                body, keep = bytearray(b"".join(chunks)), False
            else:
                body, done = bytearray(length), h.trailing_data[0]
                view, got = memoryview(body), len(done)
                view[: min(got, length)] = done[:length]
                while got < length:
                    n = sock.recv_into(view[got:])
                    if not n:
                        raise h11.RemoteProtocolError(f"{_CUT}: received {got} bytes, "
                                                      f"expected {length}")
                    got += n
                keep = got == length and _keeps(event)
        except BaseException as exc:
            if sock is not None:
                sock.close()
            error = _error(exc, http.build_request(method, url), writing)
            if error is exc:
                raise
            raise error from exc
        self._checkin(address, sock, keep)
        return self._answer(http, method, url, event, body)

    # --- asyncio -------------------------------------------------------------------
    async def asend(self, http: httpx.AsyncClient, method: str, url: httpx.URL,
                    headers: Mapping[str, str], parts: Sequence[Any],
                    size: int) -> Answer | httpx.Response | None:
        """``send`` for an ``httpx.AsyncClient``, on asyncio (else None)."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # trio, say: httpx's own transport serves it
            return None
        fields = self._headers(http, method, url, headers, size)
        if fields is None:
            return None
        address, t = (url.host, url.port or 80), http.timeout
        h, request_head = _exchange_start(method, url, fields)
        sock, writing = self._checkout(address), True
        try:
            if sock is None:
                sock = await self._connect(loop, address, t.connect)
            views = _views(request_head, parts)
            try:  # what the socket takes at once in one sendmsg, the rest as it drains
                views = _unsent(views, sock.sendmsg(views[:IOV_MAX]))
            except BlockingIOError:
                pass
            try:
                for view in views:
                    await _within(loop.sock_sendall(sock, view), t.write)
            except OSError as exc:
                if isinstance(exc, TimeoutError):
                    raise
            writing = False
            event = h.next_event()
            while not isinstance(event, h11.Response):
                if event is h11.NEED_DATA:
                    h.receive_data(await _within(loop.sock_recv(sock, _RECV), t.read))
                event = h.next_event()
            length = _length(method, event)
            if length is None:
                chunks = []
                while (got := h.next_event()) is not h11.PAUSED and not isinstance(
                        got, h11.EndOfMessage):
                    if got is h11.NEED_DATA:
                        h.receive_data(await _within(loop.sock_recv(sock, _RECV), t.read))
                    elif isinstance(got, h11.Data):
                        chunks.append(got.data)
                body, keep = bytearray(b"".join(chunks)), False
            else:
                body, done = bytearray(length), h.trailing_data[0]
                view, got = memoryview(body), len(done)
                view[: min(got, length)] = done[:length]
                while got < length:  # the read timeout counts from the last bytes
                    n = await _within(loop.sock_recv_into(sock, view[got:]), t.read)
                    if not n:
                        raise h11.RemoteProtocolError(f"{_CUT}: received {got} bytes, "
                                                      f"expected {length}")
                    got += n
                keep = got == length and _keeps(event)
        except BaseException as exc:  # cancelled too: the socket is not kept
            if sock is not None:
                sock.close()
            error = _error(exc, http.build_request(method, url), writing)
            if error is exc:
                raise
            raise error from exc
        self._checkin(address, sock, keep)
        return self._answer(http, method, url, event, body)

    @staticmethod
    async def _connect(loop: asyncio.AbstractEventLoop, address: tuple[str, int],
                       timeout: float | None) -> socket.socket:
        try:
            infos = await _within(loop.getaddrinfo(*address, type=socket.SOCK_STREAM), timeout)
            family, kind, proto, _, where = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await _within(loop.sock_connect(sock, where), timeout)
            except BaseException:
                sock.close()
                raise
        except TimeoutError as exc:
            raise httpx.ConnectTimeout("connect timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for sock, _ in conns:
                sock.close()


async def _within(awaitable: Any, seconds: float | None) -> Any:
    """``await awaitable``; TimeoutError after ``seconds`` (None: no limit). A timeout
    scope where asyncio has one (3.11+): no task per socket operation, as wait_for makes."""
    if seconds is None:
        return await awaitable
    scope = getattr(asyncio, "timeout", None)
    if scope is None:
        return await asyncio.wait_for(awaitable, seconds)
    async with scope(seconds):
        return await awaitable
