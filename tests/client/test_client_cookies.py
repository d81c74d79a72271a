"""The clients keep an answer's cookies exactly as a plain httpx client does.

A real socket server (``http.server`` in a thread) answers ``GET /health`` with a
scripted ``Set-Cookie`` header per request (or none), and records the ``Cookie``
header each request carried. The same script is played to a plain ``httpx.Client``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import httpx
import pytest

from dxclient import AsyncClient, Client
from tests.conftest import HandlerInThread

#: per request: the Set-Cookie headers of its answer (name as written, value)
SCRIPT: list[list[tuple[str, str]]] = [
    [("Set-Cookie", "lb=one; Path=/")],
    [],  # no cookie set: the jar keeps what it has
    [("SET-COOKIE", "zone=b; Path=/"), ("set-cookie", "lb=two; Path=/")],
    [],
    [("Set-Cookie", "lb=gone; Max-Age=0; Path=/")],  # deleted
    [],
]


class CookieServer:
    def __init__(self) -> None:
        self.seen: list[str | None] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.seen.append(self.headers.get("cookie"))
                body = b'{"status":"ok"}'
                self.send_response(200)
                for name, value in SCRIPT[(len(server.seen) - 1) % len(SCRIPT)]:
                    self.send_header(name, value)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.served = HandlerInThread(Handler)
        self.url = self.served.url

    def close(self) -> None:
        self.served.close()


@pytest.fixture
def cookie_server() -> Iterator[CookieServer]:
    server = CookieServer()
    yield server
    server.close()


def test_client_keeps_cookies_as_httpx_does(cookie_server: CookieServer) -> None:
    with Client(cookie_server.url) as client:
        for _ in SCRIPT:
            assert client.health() == {"status": "ok"}
        jar = dict(client.http.cookies)
    ours = list(cookie_server.seen)
    cookie_server.seen.clear()
    with httpx.Client(base_url=cookie_server.url) as http:
        for _ in SCRIPT:
            http.get("/health")
        expected = dict(http.cookies)
    assert ours == cookie_server.seen
    assert ours[1] == "lb=one" and ours[2] == "lb=one"  # an answer without cookies kept it
    assert "zone=b" in ours[3] and "lb=two" in ours[3]
    assert ours[5] == "zone=b"  # Max-Age=0 deleted lb
    assert jar == expected == {"zone": "b"}


def test_async_client_keeps_cookies_as_httpx_does(cookie_server: CookieServer) -> None:
    async def play() -> dict:
        async with AsyncClient(cookie_server.url) as client:
            for _ in SCRIPT:
                assert await client.health() == {"status": "ok"}
            return dict(client.http.cookies)

    jar = asyncio.run(play())
    ours = list(cookie_server.seen)
    cookie_server.seen.clear()
    with httpx.Client(base_url=cookie_server.url) as http:
        for _ in SCRIPT:
            http.get("/health")
    assert ours == cookie_server.seen
    assert jar == {"zone": "b"}


def test_cookies_set_on_the_client_are_sent(cookie_server: CookieServer) -> None:
    with Client(cookie_server.url) as client:
        client.http.cookies = {"session": "s1"}
        client.health()
    assert cookie_server.seen == ["session=s1"]


def test_a_given_httpx_client_keeps_its_own_jar(cookie_server: CookieServer) -> None:
    http = httpx.Client(base_url=cookie_server.url)
    with Client(http=http) as client:
        assert type(client.http.cookies) is httpx.Cookies
        client.health()
        assert dict(client.http.cookies) == {"lb": "one"}
