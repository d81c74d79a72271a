"""What every HTTP answer carries and what every request leaves behind.

An ``X-Request-ID`` (the request's own, else a new one) and a ``Server-Timing`` (total,
and decode/queue/compute/encode where the request made a service call) on the answer;
a count and a duration in ``Metrics`` by route template; with JSON logs on, one line
per request (``event`` "rejected" for 4xx/5xx, with the problem's type and detail).

``RequestRecords`` is the ASGI middleware that does it for every request;
``RequestRecord`` holds one request's part.
"""

from __future__ import annotations

import json
import logging
import random
import time
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dxcontract.operators import OPERATORS
from dxserve.http.metrics import Metrics
from dxserve.server import observe

#: An ``X-Request-ID`` sent by the client is echoed when it is this short and plain.
MAX_REQUEST_ID = 128
_log = logging.getLogger("dxserve.http")


class RequestRecord:
    """One request, from its start (``observe.CURRENT`` is set to its ``RequestInfo``)
    until ``finish``. Create it in the task that serves the request."""

    __slots__ = ("answered", "info", "start", "status", "token")

    def __init__(self, headers: list[tuple[bytes, bytes]], client: Any = None) -> None:
        self.start = time.perf_counter()
        self.info = observe.RequestInfo(request_id(headers), str(client[0]) if client else None)
        self.token = observe.CURRENT.set(self.info)
        self.status = 500  # until an answer starts
        self.answered = 0.0

    def answer_headers(self, status: int) -> list[tuple[bytes, bytes]]:
        """The headers to add to the answer of ``status``, which starts now."""
        self.status = status
        self.answered = now = time.perf_counter()
        return [
            (b"x-request-id", self.info.id.encode("latin-1")),
            (b"server-timing", server_timing(self.info, self.start, now)),
        ]

    def finish(
        self, scope: dict, route: str, metrics: Metrics, log_requests: bool, problem: bytes = b""
    ) -> None:
        """Count and time the request under ``route``, and log it with JSON logs on
        (``problem``: the body of a 4xx/5xx answer, or its start)."""
        observe.CURRENT.reset(self.token)
        seconds = time.perf_counter() - self.start
        metrics.record(route, self.status, seconds)
        if log_requests:
            log_request(scope, route, self.status, seconds, self.info, problem)


def request_id(headers: list[tuple[bytes, bytes]]) -> str:
    """The request's own ``X-Request-ID`` if it sent a usable one, else a new random id."""
    for name, value in headers:
        if name == b"x-request-id":
            if 0 < len(value) <= MAX_REQUEST_ID and value.isascii():
                text = value.decode("ascii")
                if text.isprintable():  # echoed into our own header and log lines
                    return text
            break
    # an id, not a secret: 64 bits of the process's generator (seeded from the OS,
    # and again in a forked child), without a system call per request
    return f"{random.getrandbits(64):016x}"


def server_timing(info: observe.RequestInfo, start: float, now: float) -> bytes:
    """``total`` (ms, to the answer's start), and the split of a service call: decode
    (to its start), queue and compute (when measured apart), encode (after it)."""
    total = (now - start) * 1e3
    if not info.call_start:
        return b"total;dur=%.3f" % total
    decode = (info.call_start - start) * 1e3
    if not info.call_end:
        return b"total;dur=%.3f, decode;dur=%.3f" % (total, decode)
    call, encode = info.call_end - info.call_start, (now - info.call_end) * 1e3
    if info.compute is None:  # not measured apart: the whole call counts as compute
        return b"total;dur=%.3f, decode;dur=%.3f, compute;dur=%.3f, encode;dur=%.3f" % (
            total, decode, call * 1e3, encode)
    queue = max(call - info.compute, 0.0) * 1e3
    return (
        b"total;dur=%.3f, decode;dur=%.3f, queue;dur=%.3f, compute;dur=%.3f, encode;dur=%.3f"
        % (total, decode, queue, info.compute * 1e3, encode)
    )


def log_request(
    scope: dict, route: str, status: int, seconds: float, info: observe.RequestInfo,
    problem: bytes,
) -> None:
    """The request's JSON log line (INFO, or WARNING for 4xx/5xx)."""
    fields: dict[str, Any] = {
        "event": "request" if status < 400 else "rejected", "method": scope["method"],
        "route": route, "path": scope["path"], "status": status,
        "seconds": round(seconds, 6), "request_id": info.id,
    }
    if info.function is not None:
        fields["function"] = info.function
    if info.operator is not None:
        fields["operator"] = info.operator
    if status >= 400 and problem:
        try:
            doc = json.loads(problem)
        except ValueError:
            doc = None
        if isinstance(doc, dict):
            fields["problem"] = str(doc.get("type", ""))
            if doc.get("detail"):
                fields["detail"] = str(doc["detail"])[:500]
    _log.log(
        logging.INFO if status < 400 else logging.WARNING,
        "%s %s %d %.1f ms", scope["method"], scope["path"], status, seconds * 1e3,
        extra=fields,
    )


#: Metrics labels of the operator routes, by path
_OPERATOR_ROUTES = {
    **{f"/{name}": f"/{name}" for name in OPERATORS},
    **{f"/prepare/{name}": f"/prepare/{name}" for name in OPERATORS},
}


def route_label(scope: Scope) -> str:
    """The route template a request is counted under: its route's path (``/functions/{name}``),
    or "unmatched" for a path no route serves."""
    route = scope.get("route")  # FastAPI's routes leave themselves in the scope
    if route is not None:
        return route.path
    path = scope["path"]
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):]
    endpoint = scope.get("endpoint")
    if endpoint is not None:  # a plain route: operators, and FastAPI's /docs and /openapi.json
        return _OPERATOR_ROUTES.get(path) or path
    return "unmatched"


class RequestRecords:
    """Pure ASGI middleware: every HTTP answer gets its ``X-Request-ID`` and
    ``Server-Timing``, and every request is counted, timed and (with JSON logs on)
    logged (see the module). A request that fails with an unexpected error leaves its
    ``RequestRecord`` on ``request.state.record`` for the 500 handler, which answers
    outside this middleware."""

    def __init__(self, app: ASGIApp, metrics: Metrics, log_requests: bool = False) -> None:
        self.app = app
        self.metrics = metrics
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = RequestRecord(scope["headers"], scope.get("client"))
        problem: list[bytes] = []

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [
                    *message.get("headers", ()), *record.answer_headers(message["status"])
                ]
            elif self.log_requests and record.status >= 400 and len(problem) < 4:
                problem.append(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except BaseException:
            Request(scope).state.record = record  # for the 500 handler, further out
            raise
        finally:
            record.finish(
                scope, route_label(scope), self.metrics, self.log_requests, b"".join(problem)
            )
