"""Operator POSTs served from the HTTP protocol, without the ASGI cycle.

Most requests a server answers are POSTs to an operator path, most with a small body.
On those, what sits around the endpoint (uvicorn's request-response cycle and its
``send`` messages, the middleware, Starlette's ``Response.__call__``) costs more than
decoding, computing and encoding together. ``OperatorLane`` serves them with the same
endpoint, the same problem handlers and the same ``RequestRecord`` (request id,
``Server-Timing``, metrics, JSON log line) as the ASGI way, and hands the answer to the
protocol as one call: status, headers, body parts. An operator endpoint gets the body
as it is, without a ``Request`` (``OperatorEndpoint.answer``); a ``/prepare`` endpoint
through a ``Request``, as over ASGI.

The protocol (``connections.bounded_protocol``) decides at the request's headers. It
gives the lane a POST with a ``Content-Length`` within the body limit, no
``Expect: 100-continue``, no upgrade, nothing unanswered before it on the connection,
within ``limit_concurrency``. The lane takes it if the path is an operator route and
the request does not ask for an event stream (``takes``). Every other request goes the
ASGI way, unchanged.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from .dispatch import OperatorApp, OperatorEndpoints
from .metrics import Metrics
from .records import RequestRecord
from .responses import PartsResponse
from .routes import OperatorEndpoint
from .streaming import wants_stream

#: ``send(status, headers, parts)``: writes the answer (head, then each part)
LaneSend = Callable[[int, list[tuple[bytes, bytes]], list[Any]], Awaitable[None]]


class OperatorLane:
    """Serves operator POSTs of ``app`` handed over by the protocol (see the module)."""

    def __init__(self, app: OperatorApp, metrics: Metrics, log_requests: bool) -> None:
        self.app = app
        self.service = app.state.service
        self.endpoints = OperatorEndpoints(app)
        self.internal = app.exception_handlers.get(500) or app.exception_handlers.get(Exception)
        self.metrics = metrics
        self.log_requests = log_requests

    def takes(self, scope: dict) -> bool:
        """Whether the lane serves this POST (its scope complete but for the route,
        which this sets when it does)."""
        return self.app.operator_route(scope) is not None and wants_stream(scope) is None

    async def __call__(self, scope: dict, receive: Any, send: LaneSend) -> None:
        """Serve the request of ``scope``: ``receive`` as ASGI's (the whole body in the
        first message), ``send`` writes the answer. Raises only when no answer could be
        made (the protocol then answers 500 and closes)."""
        record = RequestRecord(scope["headers"])
        response: Response | None = None
        try:
            endpoint = scope["endpoint"]
            try:
                if isinstance(endpoint, OperatorEndpoint):  # no Request
                    response = await endpoint.answer(self.service, scope, receive)
                else:
                    response = await endpoint(Request(scope, receive))
            except Exception as exc:
                request = Request(scope, receive)
                handler = self.endpoints.handler(exc)
                if handler is None:  # unexpected: answered 500, connection closed
                    response = await self.internal(request, exc)
                    response.headers["connection"] = "close"
                else:
                    response = await handler(request, exc)
            await self._send(response, record, send)
        finally:
            problem = b""
            if self.log_requests and response is not None and record.status >= 400:
                problem = bytes(response.body)
            record.finish(scope, scope["route"].path, self.metrics, self.log_requests, problem)

    @staticmethod
    async def _send(response: Response, record: RequestRecord, send: LaneSend) -> None:
        headers = [*response.raw_headers, *record.answer_headers(response.status_code)]
        if isinstance(response, PartsResponse):
            try:
                await send(response.status_code, headers, response.parts)
            finally:
                response.parts = []
                if response.on_sent is not None:
                    response.on_sent()
                    response.on_sent = None
        else:
            await send(response.status_code, headers, [response.body] if response.body else [])
        if response.background is not None:
            await response.background()
