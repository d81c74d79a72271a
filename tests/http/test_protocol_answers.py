"""Answers through the bounded protocol (``http/protocol.py``) arrive whole and in order
over real sockets: one-shot, multi-part, streamed, HEAD, ``Expect: 100-continue`` and
failing answers.
"""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest

from dxserve.http.protocol import ConnectionLimits, bounded_protocol
from tests.conftest import uvicorn_in_thread

pytestmark = pytest.mark.protocol


async def _app(scope, receive, send):
    if scope["type"] != "http":
        return
    path = scope["path"]
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if path == "/fail":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", b"100")]})
        raise RuntimeError("failed after the head")
    if path == "/stream":
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        await asyncio.sleep(0.5)
        await send({"type": "http.response.body", "body": b"data: late\n\n"})
        return
    parts = [b"part%d;" % i for i in range(5)] if path == "/parts" else [b"echo:" + body]
    size = sum(map(len, parts))
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-length", str(size).encode())]})
    for i, part in enumerate(parts):
        await send({"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1})


@pytest.fixture(scope="module")
def url():
    with uvicorn_in_thread(_app, http=bounded_protocol(ConnectionLimits()), log_level="critical") as url:
        yield url


def test_answers_arrive_whole_over_a_kept_alive_connection(url: str) -> None:
    with httpx.Client(base_url=url) as http:
        for i in range(20):
            assert http.post("/echo", content=b"x%d" % i).content == b"echo:x%d" % i
            assert http.get("/parts").content == b"".join(b"part%d;" % k for k in range(5))
        head = http.head("/echo")
        assert head.status_code == 200 and head.content == b""
        large = b"y" * 300_000
        assert http.post("/echo", content=large).content == b"echo:" + large
        expect = http.post("/echo", content=b"z", headers={"expect": "100-continue"})
        assert expect.status_code == 200 and expect.content == b"echo:z"


def test_a_streams_head_is_not_held_for_its_first_event(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nhost: x\r\n\r\n")
        first = sock.recv(65536)  # the event comes 0.5 s after the head
        assert first.startswith(b"HTTP/1.1 200") and b"late" not in first
        rest = b""
        while b"late" not in rest:
            rest += sock.recv(65536)


def test_an_answer_that_fails_after_its_head_closes_the_connection(url: str) -> None:
    with httpx.Client(base_url=url) as http:
        with pytest.raises(httpx.RemoteProtocolError):
            http.get("/fail")
        assert http.post("/echo", content=b"after").content == b"echo:after"


def test_this_uvicorn_is_one_the_protocol_is_written_for() -> None:
    import uvicorn

    from dxserve.http.protocol import supported_uvicorn

    assert supported_uvicorn(uvicorn.__version__), uvicorn.__version__
    assert bounded_protocol(ConnectionLimits()) is not None


def test_another_uvicorn_runs_without_the_bounds_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    import uvicorn

    from dxserve.cli import connection_options
    from dxserve.http.protocol import supported_uvicorn
    from dxserve.settings import Settings

    assert not supported_uvicorn("0.99.0") and not supported_uvicorn("1.0") and not supported_uvicorn("x")
    monkeypatch.setattr(uvicorn, "__version__", "0.99.0")
    log = logging.getLogger("test-protocol")
    with caplog.at_level(logging.WARNING, logger="test-protocol"):
        options = connection_options(Settings(), log)
    assert options["http"] == "auto"
    assert "header and body read timeouts" in caplog.text and "off" in caplog.text
    with caplog.at_level(logging.WARNING, logger="test-protocol"):
        options = connection_options(Settings(http="h11"), log)
    assert options["http"] == "h11" and "DXSERVE_HTTP=h11" in caplog.text
