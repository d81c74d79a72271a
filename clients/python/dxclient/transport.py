"""httpx transports for dxclient: large bodies through urllib3, small async calls through h11.

Both are public ``httpx`` transports, and their answers are ordinary ``httpx.Response``s:
httpx still builds the request, decodes a content-encoded body, stores cookies and runs
event hooks. Errors are httpx's (``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``,
``WriteError``, ``RemoteProtocolError``, ...), so retry rules built on them hold on
every path.

* ``LargeBodies`` (``Client``): httpx (through httpcore and h11) reads an answer 64 KiB
  at a time, each piece through h11's buffer, and joins the pieces at the end: for an
  8 MB answer about as much time as moving the bytes through the kernel. urllib3 (over
  the standard library's ``http.client``) reads a ``Content-Length`` body with one read
  into one bytes object, and writes a body given as parts part by part, never joined.
  Requests whose body is at least ``min_bytes``, over plain HTTP, go to urllib3; all
  others (https, small or streamed bodies, event streams) to httpx's own transport.
* ``AsyncFast`` (``AsyncClient``): httpx's async stack (anyio, httpcore) costs ~0.3 ms
  more per call than its sync one, half a small call's round trip. On asyncio, a byte
  body below ``LARGE_MIN_BYTES`` is exchanged here: h11 writes the request and parses
  the answer, over sockets kept alive per host and port; a larger one goes to
  ``LargeBodies`` in a worker thread. Other event loops, https, streamed bodies and
  event streams use httpx's own transport.
"""

from __future__ import annotations

import asyncio
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import h11
import httpx
import urllib3
from urllib3 import exceptions as u3

#: request bodies from this size on go through urllib3
LARGE_MIN_BYTES = 64 * 1024
#: kept-alive connections per host (httpx's default pool keeps up to 20 in all)
MAX_IDLE_PER_HOST = 16
#: ``request.extensions`` key of a body given as parts (bytes-like, in order): sent as
#: they are, never joined (``content=`` holds the same parts for httpx's own path)
BODY_PARTS = "dxclient.body_parts"


def large_body(request: httpx.Request, min_bytes: int) -> tuple[Any, ...] | None:
    """The request's body as parts if urllib3 sends it, else None."""
    if request.url.scheme != "http" or request.method == "HEAD":
        return None
    if "event-stream" in request.headers.get("accept", ""):
        return None  # read as it comes, by httpx
    parts = request.extensions.get(BODY_PARTS)
    if parts is None:
        if not isinstance(request.stream, httpx.ByteStream):
            return None  # streamed by its caller
        parts = (request.content,)
    if sum(memoryview(p).nbytes for p in parts) < min_bytes:
        return None
    return tuple(parts)


class _Answer(httpx.SyncByteStream):
    """A urllib3 answer's body as httpx reads a stream: in one piece."""

    def __init__(self, answer: urllib3.BaseHTTPResponse, request: httpx.Request) -> None:
        self.answer, self.request = answer, request

    def __iter__(self) -> Iterator[bytes]:
        try:
            data = self.answer.read(decode_content=False)
        except BaseException as exc:
            raise _httpx_error(exc, self.request) from exc
        if data:
            yield data

    def close(self) -> None:
        self.answer.release_conn()


def _timeout(request: httpx.Request) -> urllib3.Timeout:
    t = request.extensions.get("timeout") or {}
    return urllib3.Timeout(connect=t.get("connect"), read=t.get("read"))


def _httpx_error(exc: BaseException, request: httpx.Request) -> BaseException:
    """httpx's error for what urllib3 (or the socket under it) raised."""
    text = str(exc) or type(exc).__name__
    if isinstance(exc, u3.NewConnectionError | u3.NameResolutionError):
        kind: type[httpx.TransportError] = httpx.ConnectError
    elif isinstance(exc, u3.ConnectTimeoutError):
        kind = httpx.ConnectTimeout
    elif isinstance(exc, u3.ReadTimeoutError | TimeoutError):
        kind = httpx.ReadTimeout
    elif isinstance(exc, u3.ProtocolError | u3.IncompleteRead | u3.HTTPError):
        kind = httpx.RemoteProtocolError
    elif isinstance(exc, OSError):
        kind = httpx.WriteError if isinstance(exc, ConnectionError) else httpx.ReadError
    else:
        return exc
    return kind(text, request=request)


def _response(
    answer: urllib3.BaseHTTPResponse, stream: Any, request: httpx.Request
) -> httpx.Response:
    return httpx.Response(
        answer.status,
        headers=list(answer.headers.items()),
        stream=stream,
        request=request,
        extensions={
            "http_version": b"HTTP/1.1",
            "reason_phrase": (answer.reason or "").encode("latin-1"),
        },
    )


class LargeBodies(httpx.BaseTransport):
    """``httpx.Client(transport=LargeBodies())``: large plain-HTTP bodies through urllib3,
    everything else through ``fallback`` (httpx's own transport by default)."""

    def __init__(
        self, fallback: httpx.BaseTransport | None = None, *, min_bytes: int = LARGE_MIN_BYTES
    ) -> None:
        self.fallback = fallback if fallback is not None else httpx.HTTPTransport()
        self.min_bytes = min_bytes
        # no retries or redirects of its own: httpx and dxclient decide those
        self.pool = urllib3.PoolManager(maxsize=MAX_IDLE_PER_HOST, retries=False)

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = large_body(request, self.min_bytes)
        if body is None:
            return self.fallback.handle_request(request)
        answer = self._send(request, body)
        return _response(answer, _Answer(answer, request), request)

    def read_whole(self, request: httpx.Request, body: tuple[Any, ...]) -> httpx.Response:
        """``request`` (its body: ``body``) sent and its answer read (for a worker thread
        of ``AsyncFast``: the answer it returns streams its bytes to an async reader)."""
        answer = self._send(request, body)
        try:
            data = answer.read(decode_content=False)
        except Exception as exc:
            raise _httpx_error(exc, request) from exc
        finally:
            answer.release_conn()
        return _response(answer, httpx.ByteStream(data), request)

    def _send(self, request: httpx.Request, body: tuple[Any, ...]) -> urllib3.BaseHTTPResponse:
        try:
            return self.pool.urlopen(
                request.method,
                str(request.url),
                body=body,
                headers=dict(request.headers),
                redirect=False,
                preload_content=False,
                decode_content=False,
                timeout=_timeout(request),
            )
        except Exception as exc:
            raise _httpx_error(exc, request) from exc

    def close(self) -> None:
        self.pool.clear()
        self.fallback.close()


# --------------------------------------------------------------------------- async
#: seconds an idle connection is kept: under the server's own keep-alive timeout (uvicorn's
#: and dxserve's default is 5 s, counted from a little earlier than ours), so a connection
#: is not reused just as the server closes it
KEEPALIVE_EXPIRY = 4.0
_RECV = 256 * 1024
#: async request bodies from this size on go to ``LargeBodies`` in a worker thread
THREAD_MIN_BYTES = LARGE_MIN_BYTES


class _Conn:
    """A kept-alive socket and the h11 state of its connection."""

    __slots__ = ("h11", "idle_since", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.h11, self.idle_since = sock, h11.Connection(h11.CLIENT), 0.0

    def reusable(self, now: float) -> bool:
        """Not idle too long, and not readable while idle (the server closed it)."""
        if now - self.idle_since > KEEPALIVE_EXPIRY:
            return False
        try:
            return not select.select([self.sock], [], [], 0)[0]
        except (OSError, ValueError):
            return False


async def _within(awaitable: Any, seconds: float | None) -> Any:
    """``await awaitable``; TimeoutError after ``seconds`` (None: no limit)."""
    if seconds is None:
        return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


class AsyncFast(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=AsyncFast())``: small calls through h11 on asyncio,
    large bodies through ``LargeBodies`` in a worker thread, the rest ``fallback``."""

    def __init__(
        self,
        fallback: httpx.AsyncBaseTransport | None = None,
        *,
        thread_min_bytes: int = THREAD_MIN_BYTES,
    ) -> None:
        self.fallback = fallback if fallback is not None else httpx.AsyncHTTPTransport()
        self.thread_min_bytes = thread_min_bytes
        self.large = LargeBodies()
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # trio, say
            return await self.fallback.handle_async_request(request)
        body = large_body(request, 0)  # None: https, HEAD, a streamed body, event streams
        if body is None:
            return await self.fallback.handle_async_request(request)
        if sum(memoryview(p).nbytes for p in body) >= self.thread_min_bytes:
            return await asyncio.to_thread(self.large.read_whole, request, body)
        try:
            return await self._exchange(request, body)
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        except httpx.TransportError as exc:
            exc.request = request
            raise

    async def _exchange(self, request: httpx.Request, body: tuple[Any, ...]) -> httpx.Response:
        t = request.extensions.get("timeout") or {}
        address = (request.url.host, request.url.port or 80)
        conn = await self._checkout(address, t.get("connect"))
        try:
            head, data = await self._send_and_read(
                conn, request, body, t.get("write"), t.get("read")
            )
        except BaseException:
            conn.sock.close()
            raise
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            conn.idle_since = time.monotonic()
            self._idle.setdefault(address, []).append(conn)
        else:
            conn.sock.close()
        return httpx.Response(
            head.status_code,
            headers=head.headers,
            stream=httpx.ByteStream(data),
            extensions={"http_version": b"HTTP/" + head.http_version, "reason_phrase": head.reason},
        )

    async def _checkout(self, address: tuple[str, int], timeout: float | None) -> _Conn:
        idle, now = self._idle.get(address, []), time.monotonic()
        while idle:
            conn = idle.pop()
            if conn.reusable(now):
                return conn
            conn.sock.close()
        loop = asyncio.get_running_loop()
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
        return _Conn(sock)

    async def _send_and_read(
        self,
        conn: _Conn,
        request: httpx.Request,
        body: tuple[Any, ...],
        write_t: float | None,
        read_t: float | None,
    ) -> tuple[h11.Response, bytes]:
        loop, h = asyncio.get_running_loop(), conn.h11
        target = request.url.raw_path or b"/"
        data = h.send(
            h11.Request(method=request.method, target=target, headers=request.headers.raw)
        )
        data = b"".join([data, *(h.send(h11.Data(data=p)) for p in body if len(p))])
        data += h.send(h11.EndOfMessage())
        write_error = None
        try:
            await _within(loop.sock_sendall(conn.sock, data), write_t)
        except TimeoutError as exc:
            raise httpx.WriteTimeout("write timed out") from exc
        except OSError as exc:  # perhaps answered early (413) and closed: read the answer
            write_error = exc
        head, chunks = None, []
        try:
            while True:
                event = h.next_event()
                if event is h11.NEED_DATA:
                    h.receive_data(await _within(loop.sock_recv(conn.sock, _RECV), read_t))
                elif isinstance(event, h11.Response):
                    head = event
                elif isinstance(event, h11.Data):
                    chunks.append(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    break
        except TimeoutError as exc:
            raise httpx.ReadTimeout("read timed out") from exc
        except OSError as exc:
            raise (httpx.WriteError if write_error else httpx.ReadError)(str(exc)) from exc
        except h11.RemoteProtocolError:
            if write_error is not None and head is None:
                raise httpx.WriteError(str(write_error)) from write_error
            raise
        assert head is not None
        return head, b"".join(chunks)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.sock.close()
        self.large.close()
        await self.fallback.aclose()
