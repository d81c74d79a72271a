"""An answer's head goes out with its body's first parts, in one send.

``http.connections`` hands each request's uvicorn cycle a transport that holds the
head and small body parts back until a write brings them to ``HOLD_BYTES`` or the
answer is complete, then sends them together; what a stream writes in a turn of the
event loop without completing its answer goes out at the end of that turn.
Checked on the holder itself with a recording transport, and over real sockets through
uvicorn with the bounded protocol: one-shot, multi-part, streamed, HEAD, Expect:
100-continue and failing answers arrive whole and in order.
"""

from __future__ import annotations

import asyncio
import socket
import time

import httpx
import pytest
from conftest import uvicorn_in_thread

from dxserve.http.connections import (
    HOLD_BYTES,
    ConnectionLimits,
    _HeadWithBody,
    bounded_protocol,
)


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[bytes, ...]]] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.calls.append(("write", (bytes(data),)))

    def writelines(self, parts) -> None:
        self.calls.append(("writelines", tuple(bytes(p) for p in parts)))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def test_head_and_small_parts_in_one_turn_are_one_send() -> None:
    async def run() -> tuple[list, list]:
        sink = _Recorder()
        out = _HeadWithBody(sink, asyncio.get_running_loop())
        out.write(b"HEAD")
        out.write(b"body")
        out.write(b"more")
        held = list(sink.calls)
        await asyncio.sleep(0)  # the end of the turn sends what is held
        out.write(b"late")
        return held, sink.calls

    held, calls = asyncio.run(run())
    assert held == []
    assert calls == [("writelines", (b"HEAD", b"body", b"more")), ("write", (b"late",))]


def test_a_large_part_goes_out_at_once_with_what_was_held() -> None:
    async def run() -> list:
        sink = _Recorder()
        out = _HeadWithBody(sink, asyncio.get_running_loop())
        out.write(b"HEAD")
        out.write(b"header")
        out.write(b"x" * HOLD_BYTES)
        sent = list(sink.calls)
        out.write(b"tail")  # after the held ones went: straight through
        await asyncio.sleep(0)
        return [sent, sink.calls]

    sent, calls = asyncio.run(run())
    assert sent == [("writelines", (b"HEAD", b"header", b"x" * HOLD_BYTES))]
    assert calls == [*sent, ("write", (b"tail",))]


def test_a_complete_answer_goes_out_before_the_turn_ends() -> None:
    async def run() -> tuple[list, list]:
        sink = _Recorder()
        out = _HeadWithBody(sink, asyncio.get_running_loop())
        done: list[str] = []
        answered = out.then(lambda: done.append("answered"))
        out.write(b"HEAD")
        out.write(b"body")
        answered()  # uvicorn's on_response, once the last part is written
        return list(sink.calls), done

    calls, done = asyncio.run(run())
    assert calls == [("writelines", (b"HEAD", b"body"))] and done == ["answered"]


def test_a_head_alone_goes_out_at_the_end_of_the_turn() -> None:
    async def run() -> tuple[list, list]:
        sink = _Recorder()
        out = _HeadWithBody(sink, asyncio.get_running_loop())
        out.write(b"HEAD")
        before = list(sink.calls)
        await asyncio.sleep(0)
        out.write(b"event")
        return before, sink.calls

    before, after = asyncio.run(run())
    assert before == []
    assert after == [("write", (b"HEAD",)), ("write", (b"event",))]


def test_close_sends_a_held_head_first_and_a_closed_transport_gets_nothing() -> None:
    async def run() -> tuple[list, list]:
        sink = _Recorder()
        out = _HeadWithBody(sink, asyncio.get_running_loop())
        out.write(b"HEAD")
        out.close()
        gone = _Recorder()
        late = _HeadWithBody(gone, asyncio.get_running_loop())
        late.write(b"HEAD")
        gone.closed = True  # the client went away within the turn
        await asyncio.sleep(0)
        return sink.calls, gone.calls

    closed, gone = asyncio.run(run())
    assert closed == [("write", (b"HEAD",))]
    assert gone == []


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
    with httpx.Client(base_url=url, timeout=10) as http:
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
        started = time.monotonic()
        first = sock.recv(65536)
        waited = time.monotonic() - started
        assert first.startswith(b"HTTP/1.1 200") and b"late" not in first
        assert waited < 0.4  # the event comes 0.5 s after the head
        rest = b""
        while b"late" not in rest:
            rest += sock.recv(65536)


def test_an_answer_that_fails_after_its_head_closes_the_connection(url: str) -> None:
    with httpx.Client(base_url=url, timeout=10) as http:
        with pytest.raises(httpx.RemoteProtocolError):
            http.get("/fail")
        assert http.post("/echo", content=b"after").content == b"echo:after"
