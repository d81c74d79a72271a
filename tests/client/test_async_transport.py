"""``FastPath.asend`` (h11 over asyncio sockets) reading a large answer to a small request.

A scripted server on 127.0.0.1 answers each request with a large body sent as it is
told: in pieces with pauses, stalled halfway, or cut off. The transport must give the
exact bytes, keep httpx's per-operation read timeout (counted from the last bytes that
came, not from the start), map a cut-off to ``RemoteProtocolError``, and leave nothing
registered with the event loop, nor a connection kept, when a read is cancelled.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from dxclient.transport import FastPath

#: a stall or cut-off comes this far into the body
_WATCHED_MIN = 256 * 1024

BODY = bytes(range(256)) * ((3 * _WATCHED_MIN) // 256 + 7)

Script = Callable[[socket.socket], None]


def _read_request(conn: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionResetError("the client closed the connection")
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(rest) < length:
        rest += conn.recv(65536)


def _head(length: int = len(BODY)) -> bytes:
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/octet-stream\r\n"
        b"content-length: %d\r\n\r\n" % length
    )


@pytest.fixture
def scripted() -> Iterator[tuple[str, list[Script]]]:
    """A server running ``scripts.pop(0)`` on each request (connection kept open)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.2)
    scripts: list[Script] = []
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                while scripts and not stop.is_set():
                    _read_request(conn)
                    scripts.pop(0)(conn)
            except OSError:
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}", scripts
    stop.set()
    thread.join(5)
    listener.close()


def _in_pieces(pause: float, pieces: int = 12) -> Script:
    def script(conn: socket.socket) -> None:
        conn.sendall(_head())
        step = len(BODY) // pieces + 1
        for at in range(0, len(BODY), step):
            conn.sendall(BODY[at : at + step])
            time.sleep(pause)

    return script


def _stall_after(sent: int, seconds: float) -> Script:
    def script(conn: socket.socket) -> None:
        conn.sendall(_head() + BODY[:sent])
        time.sleep(seconds)

    return script


def _cut_after(sent: int) -> Script:
    def script(conn: socket.socket) -> None:
        conn.sendall(_head() + BODY[:sent])
        conn.shutdown(socket.SHUT_RDWR)

    return script


async def _apost(fast: FastPath, http: httpx.AsyncClient, url: str) -> bytes:
    """``POST url/x`` through ``fast`` for ``http``: the answer's body."""
    answer = await fast.asend(http, "POST", httpx.URL(url + "/x"), {}, (b"{}",))
    assert answer is not None
    return bytes(answer.content)


def _post(url: str, timeout: float = 5.0) -> bytes:
    async def go() -> bytes:
        async with httpx.AsyncClient(timeout=timeout) as http:
            return await _apost(FastPath(), http, url)

    return asyncio.run(go())


def test_a_body_in_pieces_arrives_byte_for_byte(scripted) -> None:
    url, scripts = scripted
    scripts += [_in_pieces(0.01), _in_pieces(0.0)]

    async def go() -> list[bytes]:
        fast = FastPath()
        async with httpx.AsyncClient(timeout=5) as http:
            return [await _apost(fast, http, url) for _ in range(2)]

    assert asyncio.run(go()) == [BODY, BODY]


def test_the_read_timeout_counts_from_the_last_bytes(scripted) -> None:
    """12 pieces 0.1 s apart take 1.2 s: no timeout at 0.4 s, as each piece comes in time."""
    url, scripts = scripted
    scripts.append(_in_pieces(0.1))
    assert _post(url, timeout=0.4) == BODY


def test_a_stalled_body_times_out(scripted) -> None:
    url, scripts = scripted
    scripts.append(_stall_after(_WATCHED_MIN, 3.0))
    with pytest.raises(httpx.ReadTimeout):  # the stall outlasts the timeout tenfold
        _post(url, timeout=0.3)


def test_a_body_cut_off_is_a_protocol_error(scripted) -> None:
    url, scripts = scripted
    scripts.append(_cut_after(_WATCHED_MIN + 1000))
    with pytest.raises(httpx.RemoteProtocolError, match="peer closed"):
        _post(url)


def test_a_cancelled_read_leaves_nothing_watched_and_the_client_goes_on(scripted) -> None:
    url, scripts = scripted
    scripts += [_stall_after(_WATCHED_MIN, 2.0), _in_pieces(0.0)]

    async def go() -> bytes:
        fast = FastPath()
        async with httpx.AsyncClient(timeout=5) as c:
            loop = asyncio.get_running_loop()
            watched_before = len(loop._selector.get_map())  # type: ignore[attr-defined]
            task = asyncio.ensure_future(_apost(fast, c, url))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(loop._selector.get_map()) == watched_before  # type: ignore[attr-defined]
            assert not fast._idle.get(("127.0.0.1", int(url.rsplit(":", 1)[1])))
            return await _apost(fast, c, url)

    assert asyncio.run(go()) == BODY
