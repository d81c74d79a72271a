"""Large binary bodies arrive 64-byte aligned, so the device can use their arrays as
they are (on the CPU, ``jax.device_put`` aliases them instead of copying).

Over a real socket, through uvicorn with dxserve's bounded protocol: a probe app
reports the type and alignment of the body it receives.
"""

from __future__ import annotations

import socket

import httpx
import jax
import numpy as np
import pytest
from conftest import uvicorn_in_thread

from dxclient import codec
from dxserve.http import connections
from dxserve.http.connections import ConnectionLimits, aligned_buffer, bounded_protocol
from dxserve.precision import float64_scope


@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 100_000, 800_469])
def test_aligned_buffer_is_aligned_writable_and_exact(size: int) -> None:
    buf = aligned_buffer(size)
    assert len(buf) == size and not buf.readonly
    assert np.frombuffer(buf, np.uint8).ctypes.data % 64 == 0 or size == 0
    buf[:] = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    assert bytes(buf[:3]) == bytes(range(min(size, 3)))


def test_arrays_decoded_from_an_aligned_body_are_used_without_a_copy() -> None:
    x = np.random.default_rng(0).standard_normal(100_000)
    body, headers = _binary_request(x)
    inbox = aligned_buffer(len(body))
    inbox[:] = body
    decoded = codec.decode_body(inbox, codec.BINARY_TYPE, headers[codec.HEADER_LENGTH])["x"]
    assert decoded.ctypes.data % 64 == 0
    np.testing.assert_array_equal(decoded, x)
    with float64_scope():
        on_device = jax.device_put(decoded)
    if jax.default_backend() == "cpu":
        assert on_device.unsafe_buffer_pointer() == decoded.ctypes.data  # aliased


def _binary_request(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    body, media, headers = codec.encode_body({"x": x}, "binary")
    return body, {**headers, "content-type": media}


@pytest.fixture(scope="module")
def probe_url():
    """uvicorn with the bounded protocol, serving an app that describes its body."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        message = await receive()
        body = message["body"]
        view = memoryview(body)
        report = (
            f"{type(body).__name__} {len(view)} "
            f"{np.frombuffer(view, np.uint8).ctypes.data % 64 if len(view) else 0} "
            f"{bytes(view[:8]).hex()}"
        ).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(report)).encode())]})
        await send({"type": "http.response.body", "body": report})

    with uvicorn_in_thread(app, http=bounded_protocol(ConnectionLimits()), log_level="warning") as url:
        yield url


def test_large_binary_bodies_arrive_aligned(probe_url: str) -> None:
    x = np.random.default_rng(1).standard_normal(100_000)
    body, headers = _binary_request(x)
    with httpx.Client() as http:  # plain httpx: the body arrives in many socket reads
        kind, size, offset, head = http.post(probe_url, content=body, headers=headers).text.split()
    assert (kind, int(size), int(offset), head) == ("memoryview", len(body), 0, body[:8].hex())


def test_large_json_bodies_stay_bytes_like(probe_url: str) -> None:
    """JSON bodies are searched and sliced as bytes (``response_encoding``): never a
    memoryview."""
    body = b'{"x": [' + b"1.5, " * 200_000 + b"2.0]}"
    with httpx.Client() as http:
        kind, size, _, head = http.post(
            probe_url, content=body, headers={"content-type": "application/json"}
        ).text.split()
    assert kind in ("bytearray", "bytes") and (int(size), head) == (len(body), body[:8].hex())


def test_a_large_body_is_read_into_its_own_buffer_after_a_short_first_read(
    probe_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The event loop reads a request's head (and what follows it) at most
    ``HEAD_READ_BYTES`` at a time; the rest of a large body goes straight into the body's
    buffer. Small requests before and after it on the same connection are read whole."""
    reads: list[tuple[bool, int]] = []  # (into a body's buffer, bytes)
    original = connections._Reader.buffer_updated

    def recorded(self: connections._Reader, nbytes: int) -> None:
        reads.append((self.view is not None, nbytes))
        original(self, nbytes)

    monkeypatch.setattr(connections._Reader, "buffer_updated", recorded)
    x = np.random.default_rng(2).standard_normal(100_000)
    body, headers = _binary_request(x)
    by_request = []
    url = httpx.URL(probe_url)
    with socket.create_connection((url.host, url.port)) as sock:
        for content in (b"small", body, b"small again"):
            reads.clear()
            # head and body in one write: the whole request is in the socket at once
            head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
            sock.sendall(
                f"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: {len(content)}\r\n"
                f"{head}\r\n".encode() + content
            )
            kind, size, _, first8 = _read_answer(sock).split()
            assert (int(size), first8) == (len(content), content[:8].hex())
            by_request.append(list(reads))
    assert all(by_request), "the bounded protocol reads through its _Reader"
    small, large, small_again = by_request
    assert not any(into_body for into_body, _ in small + small_again)
    # reading pauses once the head is in: one read (the head and what came with it)
    # before the application takes the body, the rest straight into the body's buffer
    first, *rest = large
    assert not first[0] and first[1] <= connections.HEAD_READ_BYTES
    assert rest and all(into_body for into_body, _ in rest)
    assert first[1] + sum(n for _, n in rest) > len(body)  # and the head


def _read_answer(sock: socket.socket) -> str:
    """The body of one HTTP/1.1 answer with a Content-Length, read from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, rest = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
        if line.lower().startswith(b"content-length:")
    )
    while len(rest) < length:
        rest += sock.recv(65536)
    return rest[:length].decode()
