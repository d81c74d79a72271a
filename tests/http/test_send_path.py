"""Every route's answer goes through one send path (``http/sending.py``), over real
sockets.

* every route of the app (``app.routes``, enumerated: a route added later is covered
  without a new test) is asked by a client that never reads, its request repeated on
  one connection until the server's answer waits for the client: the answer is seen
  waiting in the send path (``Budget.sending``), a large one's bytes held in the
  in-flight budget, and both are freed once the write timeout cuts the client off;
* unread job results and job event streams stay in the in-flight budget (requests past
  it get 503) until their clients are cut off, with uvicorn's httptools and with h11.

``/health`` is probed throughout (no stopwatch). Memory: the route
test's process stays within ``ROUTE_RSS`` of its start, the job servers within the
budget plus ``SLACK``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import LIVENESS_TIMEOUT, ServerProcess, memory_of, start_server, stop_server

PROBLEM = "application/problem+json"


def _metric(text: str, name: str) -> float:
    found = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert found, name
    return sum(float(v) for v in found)


@contextlib.contextmanager
def _liveness(url: str) -> Iterator[list[str]]:
    """``/health`` polled from a thread (``LIVENESS_TIMEOUT`` each); yields the failures."""
    failures: list[str] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=LIVENESS_TIMEOUT) as http:
            while not stop.is_set():
                try:
                    r = http.get("/health")
                    if r.status_code != 200:
                        failures.append(f"/health {r.status_code}")
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


def _unread_client(port: int, request: bytes) -> socket.socket:
    """A connection that sends ``request`` and never reads (a tiny receive window)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.settimeout(30)
    s.connect(("127.0.0.1", port))
    s.sendall(request)
    return s


def _wait(check: Callable[[], bool], what: str, timeout: float = 120.0) -> None:
    """Wait (bounded) for ``check`` to hold, polling."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


# ---------------------------------------------------------------- every route, enumerated

#: what each path parameter of a route is filled with (a new parameter name fails the
#: test until it is given a value here)
WRITE_TIMEOUT = 0.5
#: the test process's memory may grow this much over the route test (the in-process
#: server's compiled operators, the answers waiting for clients, the budget)
ROUTE_RSS = 1536 * 2**20
SMALL_X = [0.5, 1.5, 2.5]
#: a Hessian of 600 x 600 float64: 2.9 MB binary, ~7 MB of JSON (counted when unread)
BIG_N = 600


class _InProcessServer:
    """The app under uvicorn (the CLI's connection options) in a thread of this process,
    on a listening socket with a small send buffer (inherited by its connections), so
    that a few hundred kilobytes of unread answers already fill what the kernel holds."""

    def __init__(self, tmp: Path) -> None:
        import uvicorn

        from dxserve.cli import connection_options
        from dxserve.http.app import create_app
        from dxserve.settings import Settings

        settings = Settings(
            functions=["dxserve.examples"],
            store=str(tmp / "store"),
            compilation_cache="",
            warm_up=False,
            write_timeout=WRITE_TIMEOUT,
            job_poll_interval=0.2,
            max_inflight_bytes=256 * 2**20,
        )
        self.app = create_app(settings)
        self.budget = self.app.state.service.budget
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        # and a small receive buffer: a client's repeated requests block soon once the
        # server stops reading them
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        options = connection_options(settings, logging.getLogger("test-send-path"))
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="critical", **options))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self.thread.start()
        _wait(lambda: self.server.started, "uvicorn did not start", 60)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[_InProcessServer]:
    srv = _InProcessServer(tmp_path_factory.mktemp("send-path"))
    try:
        yield srv
    finally:
        srv.close()


def _request(method: str, path: str, body: bytes | None, accept: str = "*/*") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: x\r\naccept: {accept}\r\n"
    if body is not None:
        head += f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + (body or b"")


def _finished_job(url: str, body: dict, operator: str = "hessian") -> str:
    r = httpx.post(f"{url}/jobs/{operator}", json=body)
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    with httpx.stream("GET", f"{url}/jobs/{job_id}/events", timeout=300) as events:
        for line in events.iter_lines():
            if line.startswith("event: ") and line[7:] in ("result", "error"):
                assert line[7:] == "result", line
                break
    return job_id


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_every_route_is_sent_through_the_send_path(in_process: _InProcessServer) -> None:
    from starlette.routing import Route

    from dxcontract.operators import OPERATORS
    from dxserve.http.sending import SendPath

    srv = in_process
    app = srv.app
    # structurally: the send path is the app's outermost middleware of its own, so
    # every route (and every error document) is reached through it
    assert app.user_middleware[0].cls is SendPath
    layer, found = app.middleware_stack, False
    while layer is not None and not found:
        found = isinstance(layer, SendPath)
        layer = getattr(layer, "app", None)
    assert found, "SendPath is not in the app's middleware stack"
    big = json.dumps({"function": "rosenbrock", "x": [0.5] * BIG_N}).encode()
    small = json.dumps({"function": "rosenbrock", "x": SMALL_X}).encode()
    big_job = _finished_job(srv.url, {"function": "rosenbrock", "x": [0.5] * BIG_N})
    spare_job = _finished_job(srv.url, {"function": "rosenbrock", "x": SMALL_X}, "gradient")
    params = {"operator": "gradient", "name": "rosenbrock", "job_id": big_job}
    #: the routes whose answer here is large: its bytes must be seen held while unread
    large = {
        ("GET", "/jobs/{job_id}/result"),
        ("GET", "/jobs/{job_id}/events"),
        ("POST", "/hessian"),
    }
    baseline = memory_of_self()
    checked = []
    with _liveness(srv.url) as failures:
        for route in app.routes:
            assert isinstance(route, Route), f"{route!r}: not a route this test can ask"
            for method in sorted(route.methods or ()):
                if method == "HEAD":  # no body to hold
                    continue
                missing = set(route.param_convertors) - set(params)
                assert not missing, f"{route.path}: give the test a value for {missing}"
                values = dict(params)
                if method == "DELETE":  # repeated deletes of a job of no other use
                    values["job_id"] = spare_job
                path = route.path.format(**values)
                key = (method, route.path)
                body = None
                if method == "POST":  # an operator's own example, or any JSON
                    op = OPERATORS.get(path.rsplit("/", 1)[-1])
                    body = (
                        big
                        if key in large
                        else (json.dumps(dict(op.example)).encode() if op is not None else small)
                    )
                accept = "text/event-stream" if path.endswith("/events") else "*/*"
                began = time.monotonic()
                _unread_route(srv, _request(method, path, body, accept), key in large, key)
                print(key, f"{time.monotonic() - began:.1f} s")
                checked.append(key)
    assert failures == [], failures[:5]
    assert len(checked) >= len(app.routes) - 1  # every route, HEAD-only ones aside
    assert memory_of_self()["VmHWM"] - baseline["VmRSS"] < ROUTE_RSS


def memory_of_self() -> dict[str, int]:
    import os

    return memory_of(os.getpid())


def _unread_route(srv: _InProcessServer, request: bytes, large: bool, key: Any) -> None:
    """Repeat ``request`` on one connection, never reading, until an answer waits for
    the client in the send path; then see it freed when the client is cut off."""
    budget = srv.budget
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # blocks soon after the server stops
    s.connect(("127.0.0.1", srv.port))
    s.setblocking(False)
    batch = request * max(1, 16384 // len(request))
    pending = memoryview(batch)
    answers_before = budget.answers
    held_seen = waiting_seen = passed = False
    sent = 0
    ended = "deadline"
    # small answers that take long to make (a prepare) would need minutes to fill the
    # buffers: past this, seeing them pass through the send path is enough
    deadline = time.monotonic() + (60 if large else 3)
    try:
        # the server stops reading once an answer waits for this client: then sends block
        while time.monotonic() < deadline:
            blocked = False
            try:  # a send may take part of the batch: the rest goes first next time
                n = s.send(pending)
                sent += n
                pending = pending[n:] or memoryview(batch)
            except BlockingIOError:
                blocked = True
            except OSError as exc:  # cut off already: what it waited for was seen, or not
                ended = f"{type(exc).__name__} after {sent} bytes"
                break
            passed = passed or budget.answers > answers_before
            waiting_seen = blocked and budget.sending > 0
            held_seen = held_seen or budget.used > 0
            if waiting_seen and (held_seen or not large):
                break
            time.sleep(0.002)
        assert waiting_seen or (passed and not large), (
            f"{key}: no answer waited for the client ({sent} bytes asked, {ended})"
        )
        if large:
            assert held_seen, f"{key}: an unread large answer is not held in the budget"
        if waiting_seen:  # the write timeout cuts the client off: nothing stays held
            _wait(
                lambda: budget.sending == 0 and budget.used == 0,
                f"{key}: still {budget.sending} answers waiting, {budget.used} bytes held",
            )
    finally:
        s.close()
    # and whatever was still queued on the connection goes with it
    _wait(
        lambda: budget.sending == 0 and budget.used == 0,
        f"{key}: still {budget.sending} answers waiting, {budget.used} bytes held",
    )


# ---------------------------------------------------------------- unread job answers

BUDGET = 64 * 2**20
#: what a server may hold beyond its budget: XLA's buffers, the allocator's slack, the
#: kernel's socket buffers
SLACK = 400 * 2**20
N = 1000  # a Hessian job of 8 MB binary, ~20 MB of JSON
CLIENTS = 12
#: long enough for every client's answer (or refusal) to reach it before any is cut off
JOB_WRITE_TIMEOUT = 10


@pytest.fixture(scope="module", params=["httptools", "h11"])
def job_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, str]]:
    srv = start_server(
        tmp_path_factory.mktemp(f"unread-jobs-{request.param}"),
        env={
            "DXSERVE_MAX_INFLIGHT_BYTES": str(BUDGET),
            "DXSERVE_WRITE_TIMEOUT": str(JOB_WRITE_TIMEOUT),
            "DXSERVE_HTTP": request.param,
            "DXSERVE_WARM_UP": "false",
            "DXSERVE_JOB_POLL_INTERVAL": "0.2",
        },
        modules=("dxserve.examples",),
    )
    try:
        job_id = _finished_job(srv.url, {"function": "rosenbrock", "x": [0.5] * N})
        yield srv, job_id
    finally:
        stop_server(srv)


@pytest.mark.protocol
@pytest.mark.parametrize("route", ["result", "events"])
def test_unread_job_answers_stay_in_the_budget(job_server: Any, route: str) -> None:
    srv, job_id = job_server
    accept = "text/event-stream" if route == "events" else "application/json"
    request = _request("GET", f"/jobs/{job_id}/{route}", None, accept)
    with httpx.Client(base_url=srv.url) as http:
        before = http.get("/metrics").text
    refused_before = _metric(before, "dxserve_inflight_refused_total")
    baseline = memory_of(srv.proc.pid)["VmRSS"]
    clients: list[socket.socket] = []
    with _liveness(srv.url) as failures, httpx.Client(base_url=srv.url) as http:
        for _ in range(CLIENTS):  # ask, never read
            clients.append(_unread_client(srv.port, request))
        # every client has its answer begun, or its refusal: peeked, not read
        _wait(lambda: all(_outcome_of(s, route) for s in clients), "answers did not begin")
        answered = [s for s in clients if _outcome_of(s, route) == "answered"]
        text = http.get("/metrics").text
        held_seen = _metric(text, "dxserve_inflight_bytes")
        # nobody has read: each answer begun is still held in the budget, whole
        assert answered and held_seen >= len(answered) * 8 * N * N, (len(answered), held_seen)
        assert _metric(text, "dxserve_answers_sending") >= len(answered)
        # the write timeout cuts the clients off: the budget empties, nobody reading
        deadline = time.monotonic() + 240
        while True:
            text = http.get("/metrics").text
            held = _metric(text, "dxserve_inflight_bytes")
            if held == 0 and _metric(text, "dxserve_answers_sending") == 0:
                break
            assert time.monotonic() < deadline, text[-1500:]
            time.sleep(0.2)
    assert failures == [], failures[:5]
    refused = _metric(text, "dxserve_inflight_refused_total") - refused_before
    peak = _metric(text, "dxserve_inflight_peak_bytes")
    assert peak <= BUDGET, peak
    # 12 answers of ~20 MB do not fit 64 MiB at once: most are refused, none escapes
    assert refused >= CLIENTS // 2, refused
    assert memory_of(srv.proc.pid)["VmHWM"] - baseline < BUDGET + SLACK
    for s in clients:
        s.close()
    with httpx.Client(base_url=srv.url) as http:  # and it serves as before
        r = http.get(f"/jobs/{job_id}/result", headers={"accept": "application/json"})
        assert r.status_code == 200
        assert r.json()["hessian"][0][:2] == [1200 * 0.25 - 400 * 0.5 + 2, -200.0]


def _outcome_of(s: socket.socket, route: str) -> str | None:
    """What a client that reads nothing has been sent so far, peeked: "answered" (its
    answer began), "refused" (503), or None (nothing yet)."""
    try:
        data = s.recv(4096, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return None
    if route == "result":
        if not data.startswith(b"HTTP/1.1 "):
            return None
        return "refused" if data.startswith(b"HTTP/1.1 503") else "answered"
    if b"event: result" in data:
        return "answered"
    return "refused" if b"event: error" in data else None
