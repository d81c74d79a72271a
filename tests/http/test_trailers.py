"""Chunked bodies' trailers are counted against ``DXSERVE_MAX_HEADER_BYTES``, with
uvicorn's httptools protocol (``http/protocol.py``) and with h11, over real sockets.

A client sends one valid chunk, the last chunk (``0``), then trailer lines without end:
the server answers 4xx and closes the connection within a few times the limit, its
memory stays within ``RSS_GROWTH`` of where it started, and ``/health`` answers within
1 s throughout (probes, no stopwatch). A body with a few short trailers is still served.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import LIVENESS_TIMEOUT, ServerProcess, memory_of, start_server, stop_server

LIMIT = 8192
#: what an attack may add to the server's memory: far less than what was sent
RSS_GROWTH = 64 * 2**20
#: what the attacker offers per connection before giving up
OFFERED = 16 * 2**20
LINE = b"x-trailer: " + b"a" * 1000 + b"\r\n"
BODY = json.dumps({"function": "rosenbrock", "x": [1.0, 2.0, 3.0]}).encode()
HEAD = (
    b"POST /gradient HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


@pytest.fixture(scope="module", params=["httptools", "h11"])
def trailer_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    srv = start_server(
        tmp_path_factory.mktemp(f"trailers-{request.param}"),
        env={
            "DXSERVE_MAX_HEADER_BYTES": str(LIMIT),
            "DXSERVE_HTTP": request.param,
        },
        modules=("dxserve.examples",),
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def _endless_trailers(port: int) -> tuple[int, bytes]:
    """Offer trailer lines without end; (bytes the server took, what it answered)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    sent = 0
    try:
        s.sendall(HEAD + _chunk(BODY) + b"0\r\n")
        block = LINE * 64
        while sent < OFFERED:
            try:
                s.sendall(block)
            except OSError:  # closed by the server
                break
            sent += len(block)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
        return sent, answer
    finally:
        s.close()


@pytest.mark.protocol
def test_endless_trailers_are_refused_and_cost_nothing(trailer_server: ServerProcess) -> None:
    srv = trailer_server
    baseline = memory_of(srv.proc.pid)["VmRSS"]
    failures: list[str] = []
    stop = threading.Event()

    def probe() -> None:
        with httpx.Client(base_url=srv.url, timeout=LIVENESS_TIMEOUT) as http:
            while not stop.is_set():
                try:
                    if http.get("/health").status_code != 200:
                        failures.append("/health not 200")
                except Exception as exc:  # noqa: BLE001 - a timeout or a dead server
                    failures.append(f"{type(exc).__name__}: {exc}")
                stop.wait(0.2)

    results: list[tuple[int, bytes]] = []
    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    attackers = [
        threading.Thread(target=lambda: results.append(_endless_trailers(srv.port)))
        for _ in range(3)
    ]
    for t in attackers:
        t.start()
    for t in attackers:
        t.join(timeout=120)
    stop.set()
    prober.join(timeout=10)
    assert failures == [], failures[:5]
    assert len(results) == 3
    for sent, answer in results:
        assert sent < OFFERED, "the server took 16 MiB of trailers without closing"
        if answer:  # the refusal, when it reached the client before the close
            status = int(answer.split(b" ", 2)[1])
            assert status in (400, 431), answer[:200]
    assert memory_of(srv.proc.pid)["VmHWM"] - baseline < RSS_GROWTH
    assert srv.proc.poll() is None
    with httpx.Client(base_url=srv.url) as http:
        assert http.get("/health").status_code == 200


@pytest.mark.protocol
def test_a_chunked_body_with_short_trailers_is_served(trailer_server: Any) -> None:
    half = len(BODY) // 2
    data = HEAD + _chunk(BODY[:half]) + _chunk(BODY[half:]) + b"0\r\n" + b"x-checksum: abc\r\n\r\n"
    with socket.create_connection(("127.0.0.1", trailer_server.port), timeout=30) as s:
        s.sendall(data)
        answer = b""
        while b'"gradient"' not in answer or not answer.endswith(b"]}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert answer.endswith(b'{"gradient":[-400.0,1002.0,-200.0]}'), answer[-200:]
