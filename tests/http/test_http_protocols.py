"""The server on both HTTP protocols: uvicorn's httptools one with dxserve's bounds
(``http/protocol.py``, the default) and uvicorn's own h11 one (``DXSERVE_HTTP=h11``).

* Differential, over real sockets: two servers alike but for ``DXSERVE_HTTP`` answer the
  same raw requests (valid ones in every encoding, hostile ones, odd paths, HTTP/1.0,
  ``Connection: close``, bodies past the limit) with the same status, the same headers
  and the same body bytes, and a gradient's value is the analytic one.
* In process (uvicorn in a thread, the CLI's options): pipelined requests are answered in
  order, every answer keeps its request record (metrics, request id, JSON log line), a
  large body gives back the in-flight budget it held (answered, refused, or its client
  gone mid-body), an unexpected error is a 500 and the server goes on, and a body that
  trickles past the body timeout is 408.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

import dxserve
from dxclient import _models
from dxcontract.backends import JaxForward, JaxReverse
from dxserve.cli import connection_options
from dxserve.examples import rosenbrock
from dxserve.http.app import create_app
from dxserve.pipeline import OperatorCall
from dxserve.server.admission import SMALL_BYTES
from dxserve.settings import Settings
from tests.conftest import start_server, stop_server, uvicorn_in_thread

pytestmark = pytest.mark.protocol

PROBLEM = "application/problem+json"
#: headers whose values differ between any two answers
VARYING = {b"date", b"x-request-id", b"server-timing"}
X = np.array([1.0, 2.0, 3.0])
GRADIENT = np.array([-400.0, 1002.0, -200.0])  # rosenbrock at (1, 2, 3), by hand


# --------------------------------------------------------------------------- raw HTTP


def request(
    path: str, body: bytes, headers: dict[str, str] | None = None, *, method: str = "POST",
    version: str = "1.1",
) -> bytes:
    """One request's bytes (Host and Content-Length added)."""
    lines = [f"{method} {path} HTTP/{version}", "host: 127.0.0.1", f"content-length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def json_request(path: str, payload: Any, **headers: str) -> bytes:
    return request(path, json.dumps(payload).encode(), {"content-type": "application/json", **headers})


def operator_request(operator: str, encoding: str, x: np.ndarray, tangents: Any = None,
                     backend: Any = None) -> bytes:
    call = _models.operator_call(
        operator, "rosenbrock", backend or JaxReverse(), x, tangents, (), None, encoding
    )
    return request(f"/{operator}", bytes(call.body), dict(call.headers))


class Answer:
    """One HTTP answer read off a socket."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status, self.headers, self.body = status, headers, body

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k == name), None)

    def comparable(self) -> tuple:
        body = self.body
        if body.startswith(b'{"prep":"'):  # a new random handle each time
            body = json.dumps({**json.loads(body), "prep": "<handle>"}).encode()
        return (self.status, sorted(h for h in self.headers if h[0] not in VARYING), body)


def read_answer(sock: socket.socket, buffer: bytearray) -> Answer:
    """The next answer on ``sock`` (``buffer`` holds what was read past the last one)."""
    while b"\r\n\r\n" not in buffer:
        chunk = sock.recv(65536)
        assert chunk, f"closed before an answer: {bytes(buffer)[:200]!r}"
        buffer += chunk
    end = buffer.index(b"\r\n\r\n")
    head = bytes(buffer[:end]).split(b"\r\n")
    del buffer[:end + 4]
    status = int(head[0].split(b" ")[1])
    headers = [(k.strip().lower(), v.strip()) for k, _, v in (h.partition(b":") for h in head[1:])]
    length = int(next(v for k, v in headers if k == b"content-length"))
    while len(buffer) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed inside a body"
        buffer += chunk
    body = bytes(buffer[:length])
    del buffer[:length]
    return Answer(status, headers, body)


def exchange(port: int, data: bytes, answers: int = 1) -> tuple[list[Answer], bool]:
    """Send ``data`` on a new connection; the answers, and whether the server then
    closed the connection (within half a second)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        buffer = bytearray()
        got = [read_answer(sock, buffer) for _ in range(answers)]
        sock.settimeout(0.5)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
        except ConnectionResetError:  # closed with some of what was sent unread
            closed = True
        return got, closed


# --------------------------------------------------------------------------- differential

#: what both servers are given: small body limits, so that bodies can be past them
LIMITS = {"DXSERVE_MAX_BODY_BYTES": str(1 << 20), "DXSERVE_MAX_JSON_BODY_BYTES": "8192"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    on = start_server(tmp_path_factory.mktemp("httptools"), env={**LIMITS, "DXSERVE_HTTP": "httptools"},
                      modules=("dxserve.examples",))
    try:
        off = start_server(tmp_path_factory.mktemp("h11"),
                           env={**LIMITS, "DXSERVE_HTTP": "h11"},
                           modules=("dxserve.examples",))
        try:
            yield on, off
        finally:
            stop_server(off)
    finally:
        stop_server(on)


def _cases() -> dict[str, bytes]:
    ok = {"function": "rosenbrock", "x": X.tolist()}
    cases = {
        f"gradient {enc}": operator_request("gradient", enc, X) for enc in ("binary", "b64", "json")
    }
    cases |= {
        "hessian binary": operator_request("hessian", "binary", X),
        "value_and_gradient b64": operator_request("value_and_gradient", "b64", X),
        "hvp json": operator_request("hvp", "json", X, [np.ones(3)]),
        "pushforward binary": operator_request("pushforward", "binary", X, [np.ones(3)], JaxForward()),
        "json body, binary answer": json_request("/gradient", ok, accept="application/vnd.dxserve.binary"),
        "prepare": json_request("/prepare/gradient", {**ok, "backend": "jax-reverse"}),
        "query string": json_request("/gradient?debug=1", ok),
        "percent-encoded path": json_request("/%67radient", ok),
        "trailing slash": json_request("/gradient/", ok),
        "request id echoed": json_request("/gradient", ok, **{"x-request-id": "proto-test-1"}),
        "behind a proxy": json_request(
            "/gradient", ok, **{"x-forwarded-for": "10.1.2.3", "x-forwarded-proto": "https"}),
        "connection close": json_request("/gradient", ok, connection="close"),
        "http/1.0": request("/gradient", json.dumps(ok).encode(),
                            {"content-type": "application/json"}, version="1.0"),
        "bad json": request("/gradient", b"{", {"content-type": "application/json"}),
        "not an object": request("/gradient", b"[1, 2]", {"content-type": "application/json"}),
        "empty body": request("/gradient", b"", {"content-type": "application/json"}),
        "unknown field": json_request("/gradient", {**ok, "y": 1}),
        "unknown function": json_request("/gradient", {**ok, "function": "nope"}),
        "unknown backend": json_request("/gradient", {**ok, "backend": "nope"}),
        "x a string": json_request("/gradient", {**ok, "x": "1,2,3"}),
        "tangent of the wrong shape": json_request("/hvp", {**ok, "tangents": [[1.0]]}),
        "text/plain": request("/gradient", b"x=1", {"content-type": "text/plain"}),
        "binary, no header length": request(
            "/gradient", b"\0" * 64, {"content-type": "application/vnd.dxserve.binary"}),
        "binary, header past the body": request(
            "/gradient", b"\0" * 64,
            {"content-type": "application/vnd.dxserve.binary", "dxserve-header-length": "9999"}),
        "binary, odd header length": request(
            "/gradient", b"\0" * 64,
            {"content-type": "application/vnd.dxserve.binary", "dxserve-header-length": "1e3"}),
        "past the body limit": json_request("/gradient", {**ok, "x": [1.0] * 2000}),
        # received into one buffer of the declared size
        "binary, 80 KB": operator_request("gradient", "binary", np.linspace(-1, 1, 10_000)),
        "binary, 400 KB": operator_request("pushforward", "binary", np.linspace(-1, 1, 50_000),
                                           [np.ones(50_000)], JaxForward()),
        "binary, past the body limit": operator_request("gradient", "binary", np.ones(140_000)),
        "b64, past the JSON limit": operator_request("gradient", "b64", np.ones(10_000)),
        "GET on an operator path": request("/gradient", b"", method="GET"),
        "an unknown operator": json_request("/jvp", ok),
        "POST on a GET path": request("/health", b""),
    }
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", CASES)
def test_both_protocols_answer_alike(servers: tuple[Any, Any], name: str) -> None:
    bounded, h11 = servers
    data = CASES[name]
    (answer,), closed = exchange(bounded.port, data)
    (other,), other_closed = exchange(h11.port, data)
    ours, theirs = answer.comparable(), other.comparable()
    if name == "http/1.0":  # closed either way; older uvicorn httptools says so in no header
        ours, theirs = _without_connection_close(ours), _without_connection_close(theirs)
    assert ours == theirs, (name, ours, theirs)
    assert closed == other_closed, name
    assert answer.header(b"x-request-id") and answer.header(b"server-timing"), answer.headers
    if answer.status >= 400:
        assert answer.header(b"content-type") == PROBLEM.encode(), answer.headers
        doc = json.loads(answer.body)
        assert doc["status"] == answer.status and doc["detail"], doc
    if name == "request id echoed":
        assert answer.header(b"x-request-id") == b"proto-test-1"
    if name in ("connection close", "past the body limit",
                "binary, past the body limit", "b64, past the JSON limit"):
        assert closed and answer.header(b"connection") == b"close", answer.headers
    if name == "http/1.0":
        assert closed


def _without_connection_close(comparable: tuple) -> tuple:
    status, headers, body = comparable
    return status, [h for h in headers if h != (b"connection", b"close")], body


def test_a_gradient_is_the_analytic_one(servers: tuple[Any, Any]) -> None:
    for srv in servers:
        for name in ("gradient binary", "gradient b64", "gradient json"):
            (answer,), closed = exchange(srv.port, CASES[name])
            assert answer.status == 200 and not closed
            headers = httpx.Headers(answer.headers)
            got = _models.operator_result("gradient", headers, answer.body)
            np.testing.assert_allclose(got, GRADIENT, rtol=1e-12)


def test_keep_alive_and_pipelining(servers: tuple[Any, Any]) -> None:
    bounded, h11 = servers
    # operator requests, a GET and an operator request again, all in one send: answered
    # in order, the connection kept open
    data = (CASES["gradient json"] + CASES["gradient binary"] + CASES["hessian binary"]
            + request("/health", b"", method="GET") + CASES["bad json"])
    answers, closed = exchange(bounded.port, data, answers=5)
    others, other_closed = exchange(h11.port, data, answers=5)
    assert [a.comparable() for a in answers] == [a.comparable() for a in others]
    assert [a.status for a in answers] == [200, 200, 200, 200, 400]
    assert json.loads(answers[3].body) == {"status": "ok"}
    assert not closed and not other_closed


def test_a_large_body_in_pieces_with_the_next_request_behind_it(servers: tuple[Any, Any]) -> None:
    """An 800 KB binary body (its pieces reach ``BODY_SINK`` before and after the server
    admits it) sent in three writes with pauses, the next request in the same write as the
    body's last bytes: both answered, exactly, on both protocols."""
    x = np.linspace(-1.0, 1.0, 100_000)
    first, second = operator_request("gradient", "binary", x), CASES["gradient json"]
    cut = [0, 40_000, len(first) // 2, len(first)]
    expected = np.asarray(dxserve.gradient(rosenbrock, JaxReverse(), x))
    for server in servers:
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            for start, end in zip(cut[:-2], cut[1:-1], strict=True):
                sock.sendall(first[start:end])
                time.sleep(0.2)
            sock.sendall(first[cut[-2]:] + second)
            buffer = bytearray()
            big, small = read_answer(sock, buffer), read_answer(sock, buffer)
        assert big.status == 200 and small.status == 200, (big.body[:300], small.body[:300])
        headers = httpx.Headers([(k.decode(), v.decode()) for k, v in big.headers])
        got = _models.operator_result("gradient", headers, big.body)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-9)
        assert json.loads(small.body)["gradient"] == GRADIENT.tolist()


# --------------------------------------------------------------------------- in process


@pytest.fixture
def bounded_server(tmp_path: Any) -> Iterator[str]:
    """The app under uvicorn with the CLI's connection options, in this process."""
    settings = Settings(functions=["dxserve.examples"], store=str(tmp_path / "store"),
                        compilation_cache="", warm_up=False, body_timeout=1.0, log_format="json")
    options = connection_options(settings, logging.getLogger("test"))
    assert options["http"] not in ("auto", "h11")  # the bounded protocol
    with uvicorn_in_thread(create_app(settings), log_level="warning", **options) as url:
        yield url


def test_operator_posts_of_every_kind(bounded_server: str) -> None:
    url = bounded_server
    ok = {"function": "rosenbrock", "x": X.tolist()}
    with httpx.Client(base_url=url) as http:
        assert http.post("/gradient", json=ok).json()["gradient"] == GRADIENT.tolist()
        assert http.post("/prepare/gradient", json={**ok, "backend": "jax-reverse"}).status_code == 200
        big = np.linspace(-1.0, 1.0, 40_000)  # 320 KB: into one buffer, held in the budget
        call = _models.operator_call("gradient", "rosenbrock", JaxReverse(), big, None, (), None, "binary")
        r = http.post("/gradient", content=bytes(call.body), headers=call.headers)
        assert r.status_code == 200
        got = _models.operator_result("gradient", r.headers, r.content)
        np.testing.assert_allclose(got, dxserve.gradient(rosenbrock, JaxReverse(), big), rtol=1e-12)
        assert http.get("/health").status_code == 200
        assert http.post("/functions", json={}).status_code >= 400
        with http.stream("POST", "/gradient", json=ok, headers={"accept": "text/event-stream"}) as r:
            assert r.status_code == 200 and b"event: result" in r.read()
        r = http.post("/gradient", json=ok, headers={"expect": "100-continue"})
        assert r.status_code == 200 and r.json()["gradient"] == GRADIENT.tolist()


def test_every_answer_keeps_its_request_record(
    bounded_server: str, caplog: pytest.LogCaptureFixture
) -> None:
    url = bounded_server
    with httpx.Client(base_url=url) as http:
        before = _requests_counted(http.get("/metrics").text)
        with caplog.at_level(logging.INFO, logger="dxserve.http"):
            ok = http.post("/gradient", json={"function": "rosenbrock", "x": X.tolist()},
                           headers={"x-request-id": "proto-record"})
            bad = http.post("/gradient", content=b"{", headers={"content-type": "application/json"})
        after = _requests_counted(http.get("/metrics").text)
    assert ok.headers["x-request-id"] == "proto-record"
    assert ok.headers["server-timing"].startswith("total;dur=")
    assert "compute;dur=" in ok.headers["server-timing"]
    assert len(bad.headers["x-request-id"]) == 16
    assert after[("/gradient", "200")] == before.get(("/gradient", "200"), 0) + 1
    assert after[("/gradient", "400")] == before.get(("/gradient", "400"), 0) + 1
    lines = [r for r in caplog.records if getattr(r, "route", None) == "/gradient"]
    assert [(r.event, r.status) for r in lines] == [("request", 200), ("rejected", 400)]
    assert lines[0].request_id == "proto-record" and lines[0].function == "rosenbrock"
    assert lines[1].problem.endswith("malformed-request") and lines[1].detail


def test_large_bodies_give_back_what_they_held(tmp_path: Any) -> None:
    """A body past ``SMALL_BYTES`` is held in the in-flight budget while it is
    decoded and computed: answered, refused or gone, the budget is whole again."""
    settings = Settings(functions=["dxserve.examples"], store=str(tmp_path / "store"),
                        compilation_cache="", warm_up=False)
    app = create_app(settings)
    budget = app.state.service.budget
    options = connection_options(settings, logging.getLogger("test"))
    big = np.linspace(-1.0, 1.0, 40_000)  # 320 KB in binary
    bodies = {
        name: _models.operator_call("gradient", name, JaxReverse(), big, None, (), None, "binary")
        for name in ("rosenbrock", "no-such-function")
    }
    assert len(bodies["rosenbrock"].body) > SMALL_BYTES
    with uvicorn_in_thread(app, log_level="warning", **options) as url:
        with httpx.Client(base_url=url) as http:
            for name, status in (("rosenbrock", 200), ("no-such-function", 404)) * 2:
                call = bodies[name]
                r = http.post("/gradient", content=bytes(call.body), headers=call.headers)
                assert r.status_code == status, r.text
                assert budget.used == 0
        # a client gone halfway through its body: held from its head on, then given back
        call = bodies["rosenbrock"]
        data = request("/gradient", bytes(call.body), dict(call.headers))
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(data[: len(data) // 2])
            assert _within(10, lambda: budget.used > 0)
        assert _within(10, lambda: budget.used == 0)
        with httpx.Client(base_url=url) as http:  # and it still serves
            call = bodies["rosenbrock"]
            r = http.post("/gradient", content=bytes(call.body), headers=call.headers)
            got = _models.operator_result("gradient", r.headers, r.content)
            np.testing.assert_allclose(got, dxserve.gradient(rosenbrock, JaxReverse(), big),
                                       rtol=1e-12)


def _within(seconds: float, condition: Any) -> bool:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _requests_counted(text: str) -> dict[tuple[str, str], float]:
    counted = {}
    for line in text.splitlines():
        if line.startswith("dxserve_requests_total{"):
            labels = dict(part.split("=") for part in line[line.index("{") + 1:line.index("}")].split(","))
            counted[(labels["route"].strip('"'), labels["status"].strip('"'))] = float(line.split()[-1])
    return counted


def test_an_unexpected_error_is_a_500_and_the_server_goes_on(
    bounded_server: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = bounded_server
    port = httpx.URL(url).port
    original = OperatorCall.run

    async def broken(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self.op.name == "hessian":
            raise RuntimeError("a bug")
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(OperatorCall, "run", broken)
    (answer,), closed = exchange(port, CASES["hessian binary"])
    assert answer.status == 500 and closed
    assert answer.header(b"content-type") == PROBLEM.encode()
    assert answer.header(b"x-request-id")
    assert json.loads(answer.body)["detail"] == "RuntimeError; the server logged it"
    (answer,), closed = exchange(port, CASES["gradient json"])
    assert answer.status == 200 and not closed


def test_a_small_body_that_trickles_past_the_body_timeout_is_408(bounded_server: str) -> None:
    url = bounded_server
    port = httpx.URL(url).port
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /gradient HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n{")
        got = b""
        while chunk := sock.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 408 "), got[:200]
    assert b'"field":"body"' in got
    with httpx.Client(base_url=url) as http:  # and others are served
        assert http.post("/gradient", json={"function": "rosenbrock", "x": X.tolist()}).status_code == 200
