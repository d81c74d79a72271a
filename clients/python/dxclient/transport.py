"""httpx transports with a fast path for large bodies over plain HTTP/1.1.

httpx (through httpcore and h11) writes a request body in one piece but reads an answer
64 KiB at a time, each chunk through h11's buffer, and joins the chunks at the end; for
an 8 MB answer that is about as much time as moving the bytes through the kernel. The
transports here keep httpx's API, its errors and its timeouts, and send a request whose
body is at least ``min_bytes`` like this:

* the request line and headers are written together with the body in one
  ``socket.sendmsg`` (scatter-gather: the body is not copied into a joined buffer);
* the answer's head is parsed here; a ``Content-Length`` body is read with ``recv_into``
  straight into one buffer of exactly that size (chunked answers are decoded, answers
  framed by the connection's close read to the end);
* connections are kept alive and reused per host and port, as httpx does (an idle one
  that became readable, i.e. the server closed it, or that idled past
  ``KEEPALIVE_EXPIRY`` seconds, is dropped, never reused).

Everything else goes to ``fallback`` (httpx's own transport): https, small bodies,
streamed bodies, HEAD, and requests that accept ``text/event-stream``. A body the
server answers early (413) while it is still being sent is handled as httpcore does:
the answer is read and returned.

The answer's ``content`` is a ``bytearray`` (bytes-like; ``dxclient``'s decoders make
read-only views of it). A large answer is read into a buffer the transport has used
before once nothing refers to it any more (``AnswerBuffers``): memory the process
touched already takes the bytes without a page fault per 4 KiB, which for an 800 KB
answer costs more than moving it through the kernel. Timeouts apply per socket
operation, as in httpx; errors are httpx's (``ConnectError``, ``ConnectTimeout``,
``WriteError``, ``WriteTimeout``, ``ReadError``, ``ReadTimeout``,
``RemoteProtocolError``), so retry rules built on them hold for both paths.
"""

from __future__ import annotations

import asyncio
import os
import select
import socket
import sys
import sysconfig
import threading
import time
from collections.abc import Sequence
from typing import Any

import httpx

#: request bodies from this size on take the fast path
FAST_MIN_BYTES = 64 * 1024
#: seconds an idle connection is kept: under the server's own keep-alive timeout (uvicorn's
#: and dxserve's default is 5 s, counted from a little earlier than ours), so a connection
#: is not reused just as the server closes it
KEEPALIVE_EXPIRY = 4.0
MAX_IDLE_PER_HOST = 16
MAX_HEAD_BYTES = 64 * 1024
_RECV = 64 * 1024
_NO_BODY_STATUS = frozenset((204, 304))


#: ``request.extensions`` key of a body given as parts (bytes-like, in order): sent as
#: they are, never joined (``content=`` holds the same parts for httpx's own path)
BODY_PARTS = "dxclient.body_parts"


def fast_body(request: httpx.Request, min_bytes: int) -> list[Any] | None:
    """The request's body as a list of parts if the request takes the fast path, else
    None."""
    if request.url.scheme != "http" or request.method == "HEAD":
        return None
    parts = request.extensions.get(BODY_PARTS)
    if parts is not None:
        size = sum(len(memoryview(p).cast("B")) for p in parts)
        if str(size) != request.headers.get("content-length"):
            return None
    elif isinstance(request.stream, httpx.ByteStream):
        parts = [request.content]
        size = len(parts[0])
    else:  # streamed: httpx's own path
        return None
    if size < min_bytes:
        return None
    if b"event-stream" in request.headers.get("accept", "").encode("latin-1", "replace"):
        return None
    return list(parts)


def request_head(request: httpx.Request) -> bytes:
    """The request line and headers, as httpx would write them (Host included)."""
    target = request.url.raw_path or b"/"
    lines = [request.method.encode("ascii") + b" " + target + b" HTTP/1.1"]
    lines += [name + b": " + value for name, value in request.headers.raw]
    return b"\r\n".join(lines) + b"\r\n\r\n"


class _Head:
    """A parsed answer head: status, reason, raw headers and how the body is framed."""

    __slots__ = ("chunked", "headers", "keep_alive", "length", "reason", "status")

    def __init__(self, data: bytes, method: str) -> None:
        lines = data.split(b"\r\n")
        try:
            version, status, *reason = lines[0].split(b" ", 2)
            self.status = int(status)
        except ValueError:
            raise ValueError(f"malformed status line {lines[0][:80]!r}") from None
        if not version.startswith(b"HTTP/1."):
            raise ValueError(f"not an HTTP/1.x answer: {lines[0][:80]!r}")
        self.reason = reason[0].decode("latin-1") if reason else ""
        self.headers: list[tuple[bytes, bytes]] = []
        length: int | None = None
        chunked = False
        keep_alive = version == b"HTTP/1.1"
        for line in lines[1:]:
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                raise ValueError(f"malformed header line {line[:80]!r}")
            value = value.strip()
            self.headers.append((name, value))
            lower = name.lower()
            if lower == b"content-length":
                if not value.isdigit() or (length is not None and int(value) != length):
                    raise ValueError(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif lower == b"transfer-encoding":
                chunked = value.lower().endswith(b"chunked")
            elif lower == b"connection":
                keep_alive = keep_alive and b"close" not in value.lower()
        if method == "HEAD" or self.status in _NO_BODY_STATUS or self.status < 200:
            length, chunked = 0, False
        elif chunked:
            length = None
        elif length is None:  # framed by the connection's close: never reused
            keep_alive = False
        self.length, self.chunked, self.keep_alive = length, chunked, keep_alive


def _response(request: httpx.Request, head: _Head, body: Any) -> httpx.Response:
    extensions = {"http_version": b"HTTP/1.1", "reason_phrase": head.reason.encode("latin-1")}
    encoded = any(
        name.lower() == b"content-encoding" and value.lower() not in (b"identity", b"")
        for name, value in head.headers
    )
    if encoded:  # httpx decodes it while reading
        return httpx.Response(
            head.status, headers=head.headers, stream=httpx.ByteStream(bytes(body)),
            request=request, extensions=extensions,
        )
    response = httpx.Response(head.status, headers=head.headers, request=request,
                              extensions=extensions)
    # read already (httpx does not read again); not copied into bytes
    response._content = body
    response.stream = httpx.ByteStream(body)
    return response


class _Conn:
    """A socket, and the buffer its answers' heads are read into (kept with it, so a
    kept-alive connection reads into memory it has touched already)."""

    __slots__ = ("buf", "idle_since", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray(_RECV)
        self.idle_since = 0.0


def _scan(kept: list[bytearray], size: int, free: int) -> bytearray | None:
    """The first buffer of ``size`` bytes in ``kept`` that only ``kept`` refers to
    (``free``: its reference count then, as counted here)."""
    for buf in kept:
        if len(buf) == size and sys.getrefcount(buf) == free:
            return buf
    return None


def _free_refcount() -> int | None:
    """What ``_scan`` counts for a buffer that only its list holds, measured by ``_scan``
    itself; None where reference counts can't tell (not CPython, or free-threaded)."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None
    for count in range(1, 8):
        if _scan([bytearray(1)], 1, count) is not None:
            return count
    return None


class AnswerBuffers:
    """The buffers large answers are read into, kept for reuse.

    A kept buffer is handed out again only when nothing outside this pool refers to
    it: the answer, its ``content`` and every array decoded from it are gone. So
    a loop of same-sized calls reads each answer into the same memory, and an answer
    a caller keeps is never written over. Buffers from ``min_bytes`` on are kept, at
    most ``max_count`` of them and ``max_bytes`` in all (the oldest are let go first);
    smaller and larger answers get fresh memory, as they would without a pool.
    """

    def __init__(
        self, min_bytes: int = 128 * 1024, max_bytes: int = 64 * 2**20, max_count: int = 8
    ) -> None:
        self.min_bytes, self.max_bytes, self.max_count = min_bytes, max_bytes, max_count
        self._kept: list[bytearray] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> bytearray:
        """A ``bytearray`` of ``size`` bytes (its old contents, if reused: the caller
        fills all of it)."""
        if _FREE is None or not self.min_bytes <= size <= self.max_bytes:
            return bytearray(size)
        with self._lock:
            buf = _scan(self._kept, size, _FREE)
            if buf is not None:
                return buf
            buf = bytearray(size)
            self._kept.append(buf)
            held = sum(map(len, self._kept))
            while len(self._kept) > self.max_count or held > self.max_bytes:
                held -= len(self._kept.pop(0))
            return buf

    def clear(self) -> None:
        with self._lock:
            self._kept = []


_FREE = _free_refcount()


def _stale(conn: _Conn, now: float) -> bool:
    """Idle too long, or readable while idle (the server closed it, or sent junk)."""
    if now - conn.idle_since > KEEPALIVE_EXPIRY:
        return True
    try:
        readable, _, _ = select.select([conn.sock], [], [], 0)
    except (OSError, ValueError):
        return True
    return bool(readable)


#: seconds allowed to connect, to write and to read (None: no limit)
Timeouts = tuple[float | None, float | None, float | None]


def _timeouts(request: httpx.Request) -> Timeouts:
    t = request.extensions.get("timeout") or {}
    return t.get("connect"), t.get("write"), t.get("read")


def url_address(url: httpx.URL) -> tuple[str, int]:
    """The ``(host, port)`` a plain-HTTP ``url`` connects to."""
    return url.host, url.port or 80


def _exchange_args(request: httpx.Request, body: list[Any]) -> tuple:
    """``exchange``'s arguments for ``request`` (its body's parts: ``body``)."""
    close = request.headers.get("connection", "").lower() == "close"
    head = request_head(request)
    return url_address(request.url), request.method, head, body, _timeouts(request), close


def _read_error(exc: BaseException, write_error: OSError | None) -> httpx.TransportError:
    """httpx's error for a failed read (``exc``) after a write that failed, or not: a
    write that failed and no answer after it is the write's error."""
    if write_error is not None:
        return httpx.WriteError(str(write_error))
    if isinstance(exc, TimeoutError):
        return httpx.ReadTimeout(str(exc) or "read timed out")
    if isinstance(exc, ValueError | EOFError):
        return httpx.RemoteProtocolError(str(exc))
    return httpx.ReadError(str(exc))


async def _within(awaitable: Any, seconds: float | None) -> Any:
    """``await awaitable``, TimeoutError after ``seconds`` (None: no limit). A timeout
    scope where asyncio has one (3.11+): no task per socket operation, as wait_for makes."""
    if seconds is None:
        return await awaitable
    scope = getattr(asyncio, "timeout", None)
    if scope is None:  # pragma: no cover - Python 3.10
        return await asyncio.wait_for(awaitable, seconds)
    async with scope(seconds):
        return await awaitable


def _find_head_end(buf: bytearray, start: int) -> int:
    return buf.find(b"\r\n\r\n", max(0, start - 3))


# --------------------------------------------------------------------------- sync


class FastTransport(httpx.BaseTransport):
    """``httpx.Client(transport=FastTransport())``: large bodies on the fast path."""

    def __init__(
        self, fallback: httpx.BaseTransport | None = None, *, min_bytes: int = FAST_MIN_BYTES
    ) -> None:
        self.fallback = fallback if fallback is not None else httpx.HTTPTransport()
        self.min_bytes = min_bytes
        self.buffers = AnswerBuffers()
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._lock = threading.Lock()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        body = fast_body(request, self.min_bytes)
        if body is None:
            return self.fallback.handle_request(request)
        try:
            head, data = self.exchange(*_exchange_args(request, body))
        except httpx.RequestError as exc:
            exc.request = request
            raise
        return _response(request, head, data)

    def exchange(
        self, address: tuple[str, int], method: str, head: bytes, body: Sequence[Any],
        timeouts: Timeouts, close: bool = False,
    ) -> tuple[_Head, Any]:
        """Send one request on a kept-alive connection to ``address`` and read its
        answer: ``head`` is its request line and headers, ``body`` its parts. Returns
        the answer's parsed head and its body. ``close``: the request said
        ``Connection: close``, so the connection is not kept. Raises httpx's errors,
        without their ``request`` (``handle_request`` sets it)."""
        connect_t, write_t, read_t = timeouts
        conn = self._checkout(address, connect_t)
        try:
            answer, data, keep = self._exchange(conn, method, head, body, write_t, read_t)
        except BaseException:
            conn.sock.close()
            raise
        if keep and not close:
            self._checkin(address, conn)
        else:
            conn.sock.close()
        return answer, data

    def _checkout(self, key: tuple[str, int], timeout: float | None) -> _Conn:
        now = time.monotonic()
        with self._lock:
            idle = self._idle.get(key, [])
            while idle:
                conn = idle.pop()
                if not _stale(conn, now):
                    return conn
                conn.sock.close()
        try:
            sock = socket.create_connection(key, timeout=timeout)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(str(exc) or "connect timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Conn(sock)

    def _checkin(self, key: tuple[str, int], conn: _Conn) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            idle = self._idle.setdefault(key, [])
            if len(idle) < MAX_IDLE_PER_HOST:
                idle.append(conn)
                return
        conn.sock.close()

    def _exchange(
        self, conn: _Conn, method: str, request_head: bytes, body: Sequence[Any],
        write_t: float | None, read_t: float | None,
    ) -> tuple[_Head, Any, bool]:
        sock = conn.sock
        try:
            sock.settimeout(write_t)
            _send_parts(sock, [request_head, *body])
            write_error = None
        except TimeoutError as exc:
            raise httpx.WriteTimeout(str(exc) or "write timed out") from exc
        except OSError as exc:  # perhaps answered early (413) and closed: read the answer
            write_error = exc
        try:
            sock.settimeout(read_t)
            reader = _SyncReader(conn, self.buffers)
            head = reader.head(method)
            data = reader.body(head)
        except (OSError, EOFError, ValueError) as exc:
            raise _read_error(exc, write_error) from (write_error or exc)
        return head, data, head.keep_alive and write_error is None and not reader.pending

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.sock.close()
        self.buffers.clear()
        self.fallback.close()


def _iov_max() -> int:
    try:
        return max(16, os.sysconf("SC_IOV_MAX"))
    except (AttributeError, ValueError, OSError):
        return 1024


#: most buffers one ``sendmsg`` takes (Linux: 1024; more fails with EMSGSIZE, and a
#: binary body holds one part per array, so thousands of tangents pass it)
IOV_MAX = _iov_max()


def _send_parts(sock: socket.socket, parts: list[Any]) -> None:
    """Write ``parts`` in order with ``sendmsg``, ``IOV_MAX`` at a time (partial sends
    resumed)."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if len(v)]
    while views:
        views = _unsent(views, sock.sendmsg(views[:IOV_MAX]))


def _unsent(views: list[memoryview], sent: int) -> list[memoryview]:
    """What is left of ``views`` once their first ``sent`` bytes are written."""
    at = 0
    while at < len(views) and sent >= len(views[at]):
        sent -= len(views[at])
        at += 1
    rest = views[at:]
    if rest and sent:
        rest[0] = rest[0][sent:]
    return rest


class _ReaderBase:
    """The bytes read past the head (``buf[start:end]``, ``buf`` the connection's) and
    the framing logic; a Content-Length body goes into a buffer from ``buffers``."""

    def __init__(self, conn: _Conn, buffers: AnswerBuffers) -> None:
        self.buf = conn.buf  # grown by ``_fill`` when full (a compaction may shrink it)
        self.buffers = buffers
        self.start = self.end = 0

    @property
    def pending(self) -> bool:
        return self.end > self.start

    def _take(self, n: int) -> memoryview:
        view = memoryview(self.buf)[self.start : self.start + n]
        self.start += len(view)
        return view

    def _head_from_buffer(self, method: str, scanned: int) -> tuple[_Head | None, int]:
        at = _find_head_end(self.buf[: self.end], scanned)
        if at < 0:
            if self.end >= MAX_HEAD_BYTES:
                raise ValueError(f"answer head longer than {MAX_HEAD_BYTES} bytes")
            return None, self.end
        head = _Head(bytes(self.buf[:at]), method)
        self.start = at + 4
        if 100 <= head.status < 200 and head.status != 101:  # interim: the next head follows
            del self.buf[: self.start]
            self.end -= self.start
            self.start = 0
            return None, 0
        return head, 0


class _SyncReader(_ReaderBase):
    def __init__(self, conn: _Conn, buffers: AnswerBuffers) -> None:
        super().__init__(conn, buffers)
        self.sock = conn.sock

    def _fill(self) -> None:
        """Read more into ``buf`` (grown if full)."""
        if self.end == len(self.buf):
            self.buf.extend(bytes(_RECV))
        n = self.sock.recv_into(memoryview(self.buf)[self.end :])
        if not n:
            raise EOFError("server disconnected without sending a complete response")
        self.end += n

    def head(self, method: str) -> _Head:
        scanned = 0
        while True:
            head, scanned = self._head_from_buffer(method, scanned)
            if head is not None:
                return head
            self._fill()

    def into(self, view: memoryview) -> None:
        """Fill ``view``: buffered bytes first, then straight from the socket."""
        got = len(self._take_into(view))
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if not n:
                raise EOFError(f"server disconnected after {got} of {len(view)} body bytes")
            got += n

    def _take_into(self, view: memoryview) -> memoryview:
        part = self._take(min(len(view), self.end - self.start))
        view[: len(part)] = part
        return part

    def line(self) -> bytes:
        while True:
            at = self.buf.find(b"\r\n", self.start, self.end)
            if at >= 0:
                line = bytes(self.buf[self.start : at])
                self.start = at + 2
                return line
            if self.end - self.start > MAX_HEAD_BYTES:
                raise ValueError("chunk size line too long")
            self._compact()
            self._fill()

    def _compact(self) -> None:
        if self.start:
            del self.buf[: self.start]
            self.end -= self.start
            self.start = 0

    def body(self, head: _Head) -> Any:
        if head.length is not None:
            out = self.buffers.take(head.length)
            if head.length:
                self.into(memoryview(out))
            return out
        if head.chunked:
            chunks = []
            while True:
                size_line = self.line().split(b";", 1)[0].strip()
                try:
                    size = int(size_line, 16)
                except ValueError:
                    raise ValueError(f"bad chunk size {size_line[:40]!r}") from None
                if size == 0:
                    while self.line():  # trailers, up to the blank line
                        pass
                    return bytearray(b"".join(chunks))
                chunk = bytearray(size)
                self.into(memoryview(chunk))
                chunks.append(chunk)
                if self.line():
                    raise ValueError("chunk not followed by CRLF")
        out = bytearray(self.buf[self.start : self.end])  # to the connection's close
        self.start = self.end
        while True:
            data = self.sock.recv(_RECV)
            if not data:
                return out
            out += data


# --------------------------------------------------------------------------- async


class AsyncFastTransport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=AsyncFastTransport())``: the fast path on asyncio
    (``loop.sock_sendall``; the answer read with the socket watched once,
    ``_AsyncReader``); other event loops (trio) use the fallback.

    Here every plain-HTTP request with a byte body takes it by default (``min_bytes``
    0), not only large ones: httpx's async stack (anyio, httpcore) costs ~0.3 ms more
    per call than its sync one, and this path is what lets ``AsyncClient`` match
    ``Client``'s latency on small calls."""

    def __init__(
        self, fallback: httpx.AsyncBaseTransport | None = None, *,
        min_bytes: int = 0,
    ) -> None:
        self.fallback = fallback if fallback is not None else httpx.AsyncHTTPTransport()
        self.min_bytes = min_bytes
        self.buffers = AnswerBuffers()
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = fast_body(request, self.min_bytes)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # not asyncio
            body = None
        if body is None:
            return await self.fallback.handle_async_request(request)
        try:
            head, data = await self.exchange(*_exchange_args(request, body))
        except httpx.RequestError as exc:
            exc.request = request
            raise
        return _response(request, head, data)

    async def exchange(
        self, address: tuple[str, int], method: str, head: bytes, body: Sequence[Any],
        timeouts: Timeouts, close: bool = False,
    ) -> tuple[_Head, Any]:
        """``FastTransport.exchange``, on the running asyncio loop."""
        loop = asyncio.get_running_loop()
        connect_t, write_t, read_t = timeouts
        conn = await self._checkout(loop, address, connect_t)
        try:
            answer, data, keep = await self._exchange(loop, conn, method, head, body,
                                                      write_t, read_t)
        except BaseException:
            conn.sock.close()
            raise
        if keep and not close:
            conn.idle_since = time.monotonic()
            idle = self._idle.setdefault(address, [])
            if len(idle) < MAX_IDLE_PER_HOST:
                idle.append(conn)
            else:
                conn.sock.close()
        else:
            conn.sock.close()
        return answer, data

    async def _checkout(
        self, loop: asyncio.AbstractEventLoop, key: tuple[str, int], timeout: float | None,
    ) -> _Conn:
        now = time.monotonic()
        idle = self._idle.get(key, [])
        while idle:
            conn = idle.pop()
            if not _stale(conn, now):
                return conn
            conn.sock.close()
        try:
            infos = await _within(
                loop.getaddrinfo(key[0], key[1], type=socket.SOCK_STREAM), timeout)
            family, kind, proto, _, address = infos[0]
            sock = socket.socket(family, kind, proto)
            sock.setblocking(False)
            try:
                await _within(loop.sock_connect(sock, address), timeout)
            except BaseException:
                sock.close()
                raise
        except TimeoutError as exc:
            raise httpx.ConnectTimeout("connect timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(str(exc)) from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Conn(sock)

    async def _exchange(
        self, loop: asyncio.AbstractEventLoop, conn: _Conn, method: str, request_head: bytes,
        body: Sequence[Any], write_t: float | None, read_t: float | None,
    ) -> tuple[_Head, Any, bool]:
        sock = conn.sock
        write_error = None
        try:
            # small parts go together; large ones as they are (no join): as much as the
            # socket takes at once in one sendmsg, the rest as it drains
            views = [memoryview(p).cast("B") for p in body]
            if sum(len(v) for v in views) < FAST_MIN_BYTES:
                await _within(loop.sock_sendall(sock, b"".join((request_head, *views))), write_t)
            else:
                views = [v for v in (memoryview(request_head), *views) if len(v)]
                try:
                    sent = sock.sendmsg(views[:IOV_MAX])
                except (BlockingIOError, InterruptedError):
                    sent = 0
                for view in _unsent(views, sent):
                    await _within(loop.sock_sendall(sock, view), write_t)
        except TimeoutError as exc:
            raise httpx.WriteTimeout("write timed out") from exc
        except OSError as exc:
            write_error = exc
        reader = _AsyncReader(loop, conn, self.buffers, read_t)
        try:
            head, data = await reader.answer(method)
        except (OSError, EOFError, ValueError) as exc:
            raise _read_error(exc, write_error) from (write_error or exc)
        return head, data, head.keep_alive and write_error is None and not reader.pending

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.sock.close()
        self.buffers.clear()
        await self.fallback.aclose()


class _AsyncReader(_ReaderBase):
    """Reads one answer with the socket watched once (``add_reader`` at the first
    wait, removed by ``close``): each read takes what has come, and only when nothing
    has does it wait for the socket to turn readable. (``sock_recv_into`` per read
    registers the socket, makes a future and a timeout scope each time: for the head,
    then ~50 times for an 8 MB body.) A wait longer than ``timeout`` seconds is a
    ``TimeoutError``: the read timeout counts from the last bytes that came. Where
    the event loop cannot watch sockets (the proactor loop), each read is
    ``sock_recv_into``."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, conn: _Conn, buffers: AnswerBuffers,
        timeout: float | None,
    ) -> None:
        super().__init__(conn, buffers)
        self.loop, self.sock, self.timeout = loop, conn.sock, timeout
        self._waiter: asyncio.Future | None = None
        self._watched: bool | None = None  # None: not yet asked; False: cannot

    def _readable(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _timed_out(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError(f"no answer bytes for {self.timeout:g} s"))

    async def _wait(self) -> None:
        """Until the socket has bytes (or the read timeout)."""
        loop = self.loop
        self._waiter = waiter = loop.create_future()
        timer = loop.call_later(self.timeout, self._timed_out) if self.timeout is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    async def _recv_into(self, view: memoryview) -> int:
        if self._watched is None:
            try:
                self.loop.add_reader(self.sock.fileno(), self._readable)
                self._watched = True
            except NotImplementedError:  # e.g. the proactor loop on Windows
                self._watched = False
        if not self._watched:
            return await _within(self.loop.sock_recv_into(self.sock, view), self.timeout)
        while True:
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                await self._wait()

    def close(self) -> None:
        """Stop watching the socket (call once the answer is read, or the read failed)."""
        if self._watched:
            self._watched = False
            self.loop.remove_reader(self.sock.fileno())

    async def _fill(self) -> None:
        if self.end == len(self.buf):
            self.buf.extend(bytes(_RECV))
        n = await self._recv_into(memoryview(self.buf)[self.end :])
        if not n:
            raise EOFError("server disconnected without sending a complete response")
        self.end += n

    async def head(self, method: str) -> _Head:
        scanned = 0
        while True:
            head, scanned = self._head_from_buffer(method, scanned)
            if head is not None:
                return head
            await self._fill()

    async def answer(self, method: str) -> tuple[_Head, Any]:
        """The answer's head and body; the socket is not watched any more after."""
        try:
            head = await self.head(method)
            return head, await self.body(head)
        finally:
            self.close()

    async def into(self, view: memoryview) -> None:
        part = self._take(min(len(view), self.end - self.start))
        view[: len(part)] = part
        got = len(part)
        while got < len(view):
            n = await self._recv_into(view[got:])
            if not n:
                raise EOFError(f"server disconnected after {got} of {len(view)} body bytes")
            got += n

    async def line(self) -> bytes:
        while True:
            at = self.buf.find(b"\r\n", self.start, self.end)
            if at >= 0:
                line = bytes(self.buf[self.start : at])
                self.start = at + 2
                return line
            if self.end - self.start > MAX_HEAD_BYTES:
                raise ValueError("chunk size line too long")
            if self.start:
                del self.buf[: self.start]
                self.end -= self.start
                self.start = 0
            await self._fill()

    async def body(self, head: _Head) -> Any:
        if head.length is not None:
            out = self.buffers.take(head.length)
            if head.length:
                await self.into(memoryview(out))
            return out
        if head.chunked:
            chunks = []
            while True:
                size_line = (await self.line()).split(b";", 1)[0].strip()
                try:
                    size = int(size_line, 16)
                except ValueError:
                    raise ValueError(f"bad chunk size {size_line[:40]!r}") from None
                if size == 0:
                    while await self.line():
                        pass
                    return bytearray(b"".join(chunks))
                chunk = bytearray(size)
                await self.into(memoryview(chunk))
                chunks.append(chunk)
                if await self.line():
                    raise ValueError("chunk not followed by CRLF")
        out = bytearray(self.buf[self.start : self.end])
        self.start = self.end
        chunk = bytearray(_RECV)
        while True:
            n = await self._recv_into(memoryview(chunk))
            if not n:
                return out
            out += chunk[:n]
