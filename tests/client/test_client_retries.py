"""Client retries: 503 with Retry-After and connection errors, for idempotent calls only.

A real socket server (``http.server`` in a thread) scripts the answers: a number of
503s with ``Retry-After``, then 200.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import httpx
import numpy as np
import pytest

from dxclient import Client
from dxcontract.errors import DxError
from tests.conftest import HandlerInThread


class Scripted:
    """Answers 503 (Retry-After: ``retry_after``) ``fail`` times, then 200."""

    def __init__(self, fail: int, retry_after: str = "0", status: int = 503,
                 problem: bool = True) -> None:
        self.fail, self.retry_after, self.requests = fail, retry_after, []
        self.status, self.problem = status, problem  # problem=False: a proxy's plain answer
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                scripted.requests.append(self.path)
                if len(scripted.requests) <= scripted.fail:
                    body = json.dumps({"type": "about:blank", "title": "overloaded",
                                       "status": scripted.status, "code": "overloaded",
                                       "detail": "busy"}).encode()
                    self.send_response(scripted.status)
                    if scripted.problem:
                        self.send_header("content-type", "application/problem+json")
                    else:
                        body = b"Internal Server Error"
                        self.send_header("content-type", "text/plain; charset=utf-8")
                    self.send_header("retry-after", scripted.retry_after)
                else:
                    body = json.dumps({"value": 42.0, "name": "f", "kind": "expression",
                                       "description": "", "signature": {}}).encode()
                    self.send_response(200 if self.path != "/functions" else 201)
                    self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.served = HandlerInThread(Handler)
        self.url = self.served.url

    def close(self) -> None:
        self.served.close()


@pytest.fixture
def scripted() -> Iterator[type[Scripted]]:
    made: list[Scripted] = []

    def make(*args: object, **kw: object) -> Scripted:
        s = Scripted(*args, **kw)  # type: ignore[arg-type]
        made.append(s)
        return s

    yield make  # type: ignore[misc]
    for s in made:
        s.close()


def test_503_twice_then_200_is_transparent(scripted) -> None:
    srv = scripted(fail=2)
    with Client(srv.url, encoding="json") as client:
        assert float(client.value("f", "auto", np.ones(2))) == 42.0
    assert srv.requests == ["/value"] * 3


def test_retry_after_is_honoured(scripted) -> None:
    srv = scripted(fail=1, retry_after="0.3")
    with Client(srv.url, encoding="json") as client:
        start = time.monotonic()
        client.value("f", "auto", np.ones(2))
        assert time.monotonic() - start >= 0.3


def test_retry_budget_is_respected(scripted) -> None:
    srv = scripted(fail=10)
    with Client(srv.url, encoding="json", retries=2) as client, pytest.raises(DxError) as err:
        client.value("f", "auto", np.ones(2))
    assert err.value.status == 503
    assert len(srv.requests) == 3  # the call and two retries


def test_retries_off(scripted) -> None:
    srv = scripted(fail=1)
    with Client(srv.url, encoding="json", retries=0) as client, pytest.raises(DxError):
        client.value("f", "auto", np.ones(2))
    assert len(srv.requests) == 1


def test_registration_is_not_retried(scripted) -> None:
    srv = scripted(fail=1)
    with Client(srv.url, encoding="json") as client, pytest.raises(DxError):
        client.register_expression("f", "jnp.sum(x)")
    assert srv.requests == ["/functions"]


def test_connection_errors_are_retried_then_raised() -> None:
    calls = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ConnectError("refused", request=request)

    client = Client("http://dx", encoding="json", retries=2, backoff=0.0,
                    transport=httpx.MockTransport(refuse))
    with pytest.raises(httpx.ConnectError):
        client.value("f", "auto", np.ones(2))
    assert calls == ["/value"] * 3


@pytest.mark.parametrize("status", [500, 502, 504])
def test_a_proxys_plain_5xx_is_retried(scripted, status: int) -> None:
    # Ray Serve's proxy answers a plain 500 when the replica running a call dies
    srv = scripted(fail=2, status=status, problem=False)
    with Client(srv.url, encoding="json", backoff=0.01) as client:
        assert float(client.value("f", "auto", np.ones(2))) == 42.0
    assert srv.requests == ["/value"] * 3


def test_dxserves_own_500_is_not_retried(scripted) -> None:
    srv = scripted(fail=2, status=500, problem=True)
    with Client(srv.url, encoding="json", backoff=0.01) as client, pytest.raises(DxError):
        client.value("f", "auto", np.ones(2))
    assert srv.requests == ["/value"]
