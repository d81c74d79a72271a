"""Clients that are slow or never finish, over real sockets, against real servers.

* slowloris on the default configuration: 2,000 connections send part of a request's
  head and hold it; ``/health`` and a gradient still answer meanwhile, and the
  server closes every one of them with a 408 once the header timeout has passed;
* the header limit is exact: a head of ``DXSERVE_MAX_HEADER_BYTES`` bytes is served, one
  byte more is 431, however the head is split across reads;
* answers nobody reads: plain and streamed answers stay in the in-flight budget until
  written, requests past the budget get 503, a client that reads nothing for
  ``DXSERVE_WRITE_TIMEOUT`` is cut off and its bytes are freed; the server's memory stays
  within a stated bound and ``/health`` answers throughout.
"""

from __future__ import annotations

import json
import re
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import numpy as np
import pytest

from tests.conftest import LIVENESS_TIMEOUT, memory_of

X3 = [1.0, 2.0, 3.0]
GRADIENT3 = [-400.0, 1002.0, -200.0]  # rosenbrock at (1, 2, 3), by hand


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s




def _metric(text: str, name: str) -> float:
    """The sum of metric ``name``'s samples, whatever their labels."""
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, name
    return sum(float(v) for v in found)


@contextmanager
def _liveness(url: str, extra: Callable[[httpx.Client], None] | None = None) -> Iterator[list]:
    """Poll ``/health`` (and ``extra``) from a thread while the block runs, each with
    ``LIVENESS_TIMEOUT``; yields the failures (the block asserts there are none)."""
    failures: list[str] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=LIVENESS_TIMEOUT) as http:
            while not stop.is_set():
                try:
                    r = http.get("/health")
                    if r.status_code != 200:
                        failures.append(f"/health {r.status_code}")
                    if extra is not None:
                        extra(http)
                except Exception as exc:  # noqa: BLE001 - a timeout or a dead server
                    failures.append(f"{type(exc).__name__}: {exc}")
                stop.wait(0.2)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    try:
        yield failures
    finally:
        stop.set()
        thread.join(timeout=10)


def _gradient(http: httpx.Client) -> None:
    r = http.post("/gradient", json={"function": "rosenbrock", "x": X3})
    assert r.status_code == 200 and r.json() == {"gradient": GRADIENT3}, r.text


# --------------------------------------------------------------------------- slowloris


SLOWLORIS = 2000


@pytest.mark.slow
@pytest.mark.protocol
def test_slowloris_on_the_default_configuration(make_server: Any) -> None:
    srv = make_server()  # every limit at its default: headers within 10 s
    with httpx.Client(base_url=srv.url) as http:
        _gradient(http)  # compiled before the attack
    held = []
    for _ in range(SLOWLORIS):
        s = _connect(srv.port)
        s.sendall(b"POST /gradient HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        held.append(s)
    with _liveness(srv.url, _gradient) as failures:
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:  # a header line now and then, never the end
            for s in held:
                try:
                    s.sendall(b"X-a: b\r\n")
                except OSError:
                    pass
            time.sleep(1.0)
    assert failures == [], failures[:5]
    # every held connection is answered 408 and closed once its header deadline passes
    sel = selectors.DefaultSelector()
    got: dict[socket.socket, bytes] = {}
    for s in held:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
        got[s] = b""
    open_ = set(held)
    deadline = time.monotonic() + 120  # the 10 s deadline, on a busy machine
    while open_ and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=1.0):
            s = key.fileobj
            try:
                chunk = s.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except ConnectionResetError:
                chunk = b""
            if chunk:
                got[s] += chunk
            else:
                sel.unregister(s)
                open_.discard(s)
    sel.close()
    assert not open_, f"{len(open_)} connections still open"
    timed_out = [s for s in held if got[s].startswith(b"HTTP/1.1 408 ")]
    assert len(timed_out) == SLOWLORIS, {got[s][:40] for s in held}
    assert all(b'"field":"headers"' in got[s] for s in timed_out)
    for s in held:
        s.close()
    with httpx.Client(base_url=srv.url) as http:
        _gradient(http)


# --------------------------------------------------------------------------- header bytes


def _head(total: int, path: str = "/health") -> bytes:
    """A GET whose head (request line to the blank line, inclusive) is ``total`` bytes."""
    start = f"GET {path} HTTP/1.1\r\nhost: x\r\nx-pad: ".encode()
    end = b"\r\n\r\n"
    pad = total - len(start) - len(end)
    assert pad > 0
    return start + b"a" * pad + end


def _answer_status(sock: socket.socket) -> int:
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return int(data.split(b" ", 2)[1]) if data else 0


LIMIT = 8192


@pytest.fixture(scope="module")
def header_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.conftest import start_server, stop_server

    srv = start_server(tmp_path_factory.mktemp("headers"),
                       env={"DXSERVE_MAX_HEADER_BYTES": str(LIMIT)}, modules=("dxserve.examples",))
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.mark.protocol
@pytest.mark.parametrize("split", ["whole", "at 4096", "one byte short of the end", "at the limit"])
def test_the_header_limit_is_exact(header_server: Any, split: str) -> None:
    for total, status in ((LIMIT, 200), (LIMIT + 1, 431), (LIMIT + 20_000, 431)):
        data = _head(total)
        cut = {"whole": len(data), "at 4096": 4096, "one byte short of the end": len(data) - 1,
               "at the limit": LIMIT}[split]
        with _connect(header_server.port) as s:
            s.sendall(data[:cut])
            if cut < len(data):
                time.sleep(0.05)  # a read apart
                try:
                    s.sendall(data[cut:])
                except OSError:  # refused already
                    pass
            assert _answer_status(s) == status, (split, total)


@pytest.mark.protocol
def test_the_header_limit_holds_for_a_request_after_a_body(header_server: Any) -> None:
    """A head behind another request's body on one connection is counted too."""
    body = b'{"function": "rosenbrock", "x": [1.0, 2.0, 3.0]}'
    first = (b"POST /gradient HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
             b"content-length: %d\r\n\r\n" % len(body)) + body
    with _connect(header_server.port) as s:
        s.sendall(first + _head(LIMIT + 20_000))
        data = b""
        while chunk := s.recv(65536):  # both answers, then the server closes
            data += chunk
    assert data.startswith(b"HTTP/1.1 200 "), data[:200]
    assert b'{"gradient":[-400.0,1002.0,-200.0]}' in data
    assert b"HTTP/1.1 431 " in data, data[-300:]


# --------------------------------------------------------------------------- unread answers

#: the in-flight budget of the servers below, and what they may hold beyond it: XLA's
#: buffers for one computation, the allocator's slack, the kernel's socket buffers
BUDGET = 64 * 2**20
SLACK = 400 * 2**20
N = 1000  # a Hessian of 8 MB (binary), 32 MB held with its JSON text


@pytest.fixture(scope="module")
def reader_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from tests.conftest import start_server, stop_server

    srv = start_server(
        tmp_path_factory.mktemp("readers"),
        env={"DXSERVE_MAX_INFLIGHT_BYTES": str(BUDGET), "DXSERVE_WRITE_TIMEOUT": "2"},
        modules=("dxserve.examples",),
    )
    try:
        with httpx.Client(base_url=srv.url, timeout=300) as http:  # compiled first
            r = http.post("/hessian", json={"function": "rosenbrock", "x": [0.5] * N},
                          headers={"accept": "application/vnd.dxserve.binary"})
            assert r.status_code == 200
        yield srv
    finally:
        stop_server(srv)


def _hessian_request(accept: str) -> bytes:
    body = json.dumps({"function": "rosenbrock", "x": [0.5] * N}).encode()
    return (b"POST /hessian HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"accept: %s\r\ncontent-length: %d\r\n\r\n" % (accept.encode(), len(body))) + body


def _expected_hessian_corner() -> np.ndarray:
    """H[:2, :2] of rosenbrock at x = 0.5 everywhere, by hand."""
    # d2/dx0^2 = 1200 x0^2 - 400 x1 + 2; d2/dx1^2 adds 200; d2/dx0dx1 = -400 x0
    return np.array([[1200 * 0.25 - 400 * 0.5 + 2, -200.0],
                     [-200.0, 200 + 1200 * 0.25 - 400 * 0.5 + 2]])


@pytest.mark.protocol
@pytest.mark.parametrize("accept", ["application/vnd.dxserve.binary", "text/event-stream"])
def test_unread_answers_stay_in_the_budget_and_are_cut_off(reader_server: Any, accept: str) -> None:
    srv = reader_server
    baseline = memory_of(srv.proc.pid)["VmRSS"]
    clients = [_connect(srv.port) for _ in range(24)]
    with _liveness(srv.url) as failures:
        for s in clients:  # ask, never read
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.sendall(_hessian_request(accept))
        # every answer is either refused (503 while the budget is full) or computed,
        # held until written, and its client cut off after the write timeout: the
        # budget empties again with nobody reading
        with httpx.Client(base_url=srv.url) as http:
            deadline = time.monotonic() + 240
            while True:
                text = http.get("/metrics").text
                settled = _metric(text, "dxserve_device_pending") == 0
                if settled and _metric(text, "dxserve_inflight_bytes") == 0:
                    break
                assert time.monotonic() < deadline, text[-2000:]
                time.sleep(0.5)
            peak = _metric(text, "dxserve_inflight_peak_bytes")
            refused = _metric(text, "dxserve_inflight_refused_total")
    assert failures == [], failures[:5]
    assert peak <= BUDGET, peak
    assert refused > 0  # 24 answers of 8-32 MB do not fit 64 MiB at once
    assert memory_of(srv.proc.pid)["VmHWM"] - baseline < BUDGET + SLACK
    statuses = []
    for s in clients:  # what each got: a head, and for a plain answer then a cut
        s.settimeout(5)
        try:
            head = s.recv(64)
        except (ConnectionResetError, TimeoutError):
            head = b""
        statuses.append(head[:12])
        s.close()
    if accept == "text/event-stream":  # streams answer 200 at once, errors as events
        assert all(h in (b"HTTP/1.1 200", b"") for h in statuses), statuses
    else:
        assert b"HTTP/1.1 503" in statuses and b"HTTP/1.1 200" in statuses, statuses
    with httpx.Client(base_url=srv.url) as http:  # and it serves as before
        r = http.post("/hessian", json={"function": "rosenbrock", "x": [0.5] * N})
        np.testing.assert_allclose(np.asarray(r.json()["hessian"])[:2, :2],
                                   _expected_hessian_corner(), rtol=1e-12)
