"""Operator calls through the clients' fast path (``dxclient.transport.FastPath``).

Against the real server: results equal to those sent through plain httpx transports,
problems raised alike, both clients. Against a scripted ``http.server`` (a real socket)
that records each request's head and answers with a canned gradient: header changes on
the httpx client reach the request; every client setting httpx acts on per request
(auth, hooks, cookies, params, redirects) holds (the fast path leaves such calls to
httpx); answers that set cookies,
are gzip-encoded or repeat a header are handled as httpx handles them; calls log as
httpx does; connection errors are httpx's, with their request.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import Any

import httpx
import numpy as np
import pytest

from dxclient import AsyncClient, Client, _models
from dxcontract import codec
from dxcontract.backends import JaxReverse
from dxcontract.errors import UnknownFunctionError
from tests.conftest import HandlerInThread, free_port

N = 20_000  # 160 KB of float64


def _x(n: int = N, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-1.5, 1.5, n)


# --- against the real server ----------------------------------------------------------
def _requests(client: Client | AsyncClient) -> int:
    """Requests ``client`` sent through its fast path."""
    assert client._fast is not None
    return client._fast.requests


@pytest.mark.parametrize("encoding", ["binary", "b64", "json"])
def test_results_equal_plain_httpx_results(server, encoding: str) -> None:
    backend = JaxReverse()
    large = Client(server.url, encoding=encoding)
    plain = Client(encoding=encoding, http=httpx.Client(base_url=server.url))
    try:
        for seed, x in enumerate([_x(), _x(N, 1)[::2].copy(), _x(N).astype(">f8")]):
            got = large.gradient("rosenbrock", backend, x)
            want = plain.gradient("rosenbrock", backend, x)
            assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), seed
            value, grad = large.value_and_gradient("rosenbrock", backend, x)
            assert np.array_equal(grad, want)
        prep = large.prepare_gradient("rosenbrock", backend, _x())
        np.testing.assert_array_equal(
            large.gradient("rosenbrock", backend, _x(), prep=prep),
            plain.gradient("rosenbrock", backend, _x()),
        )
        assert _requests(large) >= 8
    finally:
        large.close()
        plain.close()


def test_problem_raises_as_through_plain_httpx(server) -> None:
    plain = Client(http=httpx.Client(base_url=server.url))
    with Client(server.url) as client, plain:
        with pytest.raises(UnknownFunctionError) as large_error:
            client.gradient("no_such_function", JaxReverse(), _x())
        with pytest.raises(UnknownFunctionError) as httpx_error:
            plain.gradient("no_such_function", JaxReverse(), _x())
    assert str(large_error.value) == str(httpx_error.value)
    assert large_error.value.status == httpx_error.value.status == 404


def test_async_results_equal_plain_httpx_results(server) -> None:
    async def both() -> tuple[list, list]:
        plain_http = httpx.AsyncClient(base_url=server.url)
        async with AsyncClient(server.url) as ours, AsyncClient(http=plain_http) as plain:
            xs = [_x(), _x(10), _x(N).astype(np.float32), _x(200_000)]
            got = [await ours.gradient("rosenbrock", JaxReverse(), x) for x in xs]
            want = [await plain.gradient("rosenbrock", JaxReverse(), x) for x in xs]
            return got, want

    got, want = asyncio.run(both())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.tobytes() == w.tobytes()


def test_small_calls_take_the_fast_path_too(server) -> None:
    with Client(server.url) as client:
        client.gradient("rosenbrock", JaxReverse(), _x(10))
        client.health()  # not an operator call: through httpx
        assert _requests(client) == 1


# --- against a scripted server ---------------------------------------------------------
class ScriptedServer:
    """Answers every POST with ``gradient = 2 x`` (binary) and records each request's
    head (its lines in order, as received); ``extra`` headers are added to the answers,
    ``gzip`` compresses them."""

    def __init__(self) -> None:
        self.heads: list[bytes] = []
        self.extra: list[tuple[str, str]] = []
        self.gzip = False
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                lines = [self.requestline, *(f"{k}: {v}" for k, v in self.headers.items())]
                server.heads.append("\r\n".join(lines).encode("latin-1") + b"\r\n\r\n")
                body = self.rfile.read(int(self.headers["content-length"]))
                request = codec.decode_body(
                    body, self.headers["content-type"], self.headers.get(codec.HEADER_LENGTH)
                )
                x = np.asarray(codec.decode_result(request["x"], "x", False))
                answer, media, headers = codec.encode_body({"gradient": 2 * x}, "binary")
                if server.gzip:
                    answer = gzip.compress(answer)
                    headers = {**headers, "content-encoding": "gzip"}
                self.send_response(200)
                self.send_header("content-type", media)
                for name, value in [*headers.items(), *server.extra]:
                    self.send_header(name, value)
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.served = HandlerInThread(Handler)
        self.url = self.served.url

    def close(self) -> None:
        self.served.close()


@pytest.fixture
def scripted() -> Iterator[ScriptedServer]:
    server = ScriptedServer()
    yield server
    server.close()


def test_header_changes_reach_the_request(scripted: ScriptedServer) -> None:
    with Client(scripted.url) as client:
        for n in (N, N + 1, 3 * N):
            x = _x(n)
            np.testing.assert_array_equal(client.gradient("f", JaxReverse(), x), 2 * x)
        client.http.headers["authorization"] = "Bearer new-token"
        client.http.headers["x-trace"] = "abc"
        client.gradient("f", JaxReverse(), _x())
        head = scripted.heads[-1].lower()
        assert b"\r\nauthorization: bearer new-token\r\n" in head
        assert b"\r\nx-trace: abc\r\n" in head
        assert head.startswith(b"post /gradient http/1.1\r\n")
        assert _requests(client) == 4


SEEN: list[str] = []


def _settings() -> list[tuple[str, Any]]:
    seen = SEEN

    def hook(request: httpx.Request) -> None:
        seen.append(request.url.path)

    return [
        ("auth", lambda http: setattr(http, "auth", httpx.BasicAuth("u", "p"))),
        ("event hook", lambda http: http.event_hooks["request"].append(hook)),
        ("cookie", lambda http: http.cookies.set("session", "s1")),
        ("params", lambda http: setattr(http, "params", {"q": "1"})),
        ("redirects", lambda http: setattr(http, "follow_redirects", True)),
    ]


@pytest.mark.parametrize("name, apply", _settings(), ids=[s[0] for s in _settings()])
def test_client_settings_httpx_acts_on_hold_for_operator_calls(
    scripted: ScriptedServer, name: str, apply: Any
) -> None:
    SEEN.clear()
    with Client(scripted.url) as client:
        apply(client.http)
        x = _x()
        np.testing.assert_array_equal(client.gradient("f", JaxReverse(), x), 2 * x)
        assert _requests(client) == 0, name  # left to httpx
    head = scripted.heads[-1].lower()
    if name == "auth":
        assert b"\r\nauthorization: basic " in head
    elif name == "cookie":
        assert b"\r\ncookie: session=s1\r\n" in head
    elif name == "params":
        assert head.startswith(b"post /gradient?q=1 ")
    elif name == "event hook":
        assert SEEN == ["/gradient"]


def test_answer_setting_a_cookie_is_stored_as_httpx_stores_it(scripted: ScriptedServer) -> None:
    scripted.extra = [("Set-Cookie", "lb=one; Path=/")]
    with Client(scripted.url) as client:
        x = _x()
        np.testing.assert_array_equal(client.gradient("f", JaxReverse(), x), 2 * x)
        assert dict(client.http.cookies) == {"lb": "one"}
        scripted.extra = []
        np.testing.assert_array_equal(client.gradient("f", JaxReverse(), x), 2 * x)
    assert b"\r\ncookie: lb=one\r\n" in scripted.heads[-1].lower()


def test_gzip_answer_is_decoded(scripted: ScriptedServer) -> None:
    scripted.gzip = True
    with Client(scripted.url) as client:
        x = _x()
        np.testing.assert_array_equal(client.gradient("f", JaxReverse(), x), 2 * x)
        assert _requests(client) == 1


def test_repeated_answer_headers_join_as_in_httpx(scripted: ScriptedServer) -> None:
    scripted.extra = [("X-Multi", "a"), ("x-multi", "b")]
    with Client(scripted.url) as client:
        call = _models.operator_call("gradient", "f", JaxReverse(), _x(), None, (), None, "binary")
        assert client._fast is not None
        answer = client._fast.send(
            client.http, "POST", client._url(call), call.headers, (call.body,)
        )
        assert answer is not None
    with httpx.Client() as http:
        plain = http.post(client._url(call), content=call.body, headers=call.headers)
    assert answer.headers["X-MULTI"] == plain.headers["x-multi"] == "a, b"
    assert answer.headers.get("Content-Type") == plain.headers["content-type"]
    assert "content-length" in answer.headers and "nope" not in answer.headers
    assert answer.content == plain.content


def test_large_calls_log_as_httpx(
    scripted: ScriptedServer, caplog: pytest.LogCaptureFixture
) -> None:
    with Client(scripted.url) as client, caplog.at_level(logging.INFO, logger="httpx"):
        client.gradient("f", JaxReverse(), _x())
    assert any(
        r.name == "httpx"
        and r.getMessage() == f'HTTP Request: POST {scripted.url}/gradient "HTTP/1.1 200 OK"'
        for r in caplog.records
    )


def test_connection_errors_are_httpx_errors_with_their_request() -> None:
    port = free_port()  # nothing listens here
    with Client(f"http://127.0.0.1:{port}", retries=0) as client:
        with pytest.raises(httpx.ConnectError) as caught:
            client.gradient("f", JaxReverse(), _x())
    assert str(caught.value.request.url) == f"http://127.0.0.1:{port}/gradient"

    async def acall() -> None:
        async with AsyncClient(f"http://127.0.0.1:{port}", retries=0) as client:
            await client.gradient("f", JaxReverse(), _x())

    with pytest.raises(httpx.ConnectError) as caught:
        asyncio.run(acall())
    assert caught.value.request.method == "POST"


def test_a_server_that_hangs_up_gives_an_httpx_error() -> None:
    """A server that reads the request's first bytes and closes the connection: httpx's
    error for it, with its request."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve() -> None:
        conn, _ = listener.accept()
        conn.recv(65536)
        conn.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with Client(f"http://127.0.0.1:{port}", retries=0) as client:
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)) as e:
            client.gradient("f", JaxReverse(), _x())
    assert e.value.request.url.path == "/gradient"
    thread.join(timeout=10)
    listener.close()


def test_a_closed_client_refuses_as_httpx_does(scripted: ScriptedServer) -> None:
    client = Client(scripted.url)
    client.gradient("f", JaxReverse(), _x())
    client.close()
    with pytest.raises(RuntimeError, match="client has been closed"):
        client.gradient("f", JaxReverse(), _x())
