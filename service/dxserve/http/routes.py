"""The HTTP endpoints: decode, call the ``Service``, encode. Nothing else.

Each endpoint finds the service on ``request.app.state.service``; no endpoint holds
state of its own.
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.types import Receive

from dxclient import codec
from dxclient.encodings import binary
from dxclient.errors import (
    MalformedRequestError,
    OverloadedError,
    PayloadTooLargeError,
    UnsupportedMediaTypeError,
)
from dxclient.operators import OperatorSpec

from ..budget import DECODE_FACTOR, ENCODE_FACTOR, InFlight, Ticket
from ..jobs import Job, JobCancelled
from ..service import Action, Service
from .responses import BodyResponse, PartsResponse
from .streaming import DisconnectWatch, EventStream, wants_stream
from .wire import (
    OperatorRequest,
    decode_operator_request,
    response_encoding,
    result_nbytes,
    results_to_wire,
    wire_headers,
)

#: Bodies above this are decoded and encoded off the event loop ...
LARGE_BYTES = 256 * 1024
#: ... unless that takes no longer than a small one: a binary body with a small header
#: (views of itself), or a JSON body up to this size whose arrays are long base64 strings
#: (lifted out before parsing: ~0.1 ms per MB to decode or encode)
B64_INLINE_BYTES = 16 * 1024 * 1024


#: A scope key: the running event loop, where the server puts it in the scope. On
#: Python 3.11 each ``asyncio.get_running_loop()`` is a ``getpid`` system call.
LOOP = "dxserve.loop"


def service_of(request: Request) -> Service:
    return request.app.state.service


def bearer_token(request: Request) -> str | None:
    """The bearer token presented (``""`` for another scheme), None without the header."""
    return bearer_token_of(request.scope["headers"])


def bearer_token_of(headers: list[tuple[bytes, bytes]]) -> str | None:
    """``bearer_token`` of an ASGI request's headers (the first ``Authorization``)."""
    given = next((value for name, value in headers if name == b"authorization"), None)
    if given is None:
        return None
    scheme, _, token = given.decode("latin-1").partition(" ")
    return token if scheme.lower() == "bearer" else ""


def authorize(request: Request, action: Action) -> None:
    service_of(request).authorize(bearer_token(request), action)


async def read_body(
    request: Request, limit: int, declared: str | None = None,
    ticket: Ticket | None = None, factor: int = 1,
) -> bytes:
    """The whole body, refused (413) past ``limit`` bytes. ``declared``: the request's
    Content-Length if the caller has read it already, else it is looked up here.
    ``ticket``: holds ``factor`` times the bytes read in the in-flight budget (503 past it)."""
    if declared is None:
        declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(declared, limit)
    # Straight from ASGI receive, not ``request.stream()``: a small body is one message,
    # returned as is (the async generator and the join cost ~5 us per small request).
    chunks: list[bytes] = []
    size, more = 0, True
    while more:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect()
        chunk = message.get("body", b"")
        more = message.get("more_body", False)
        size += len(chunk)
        if size > limit:
            err = PayloadTooLargeError(f"body exceeds the limit of {limit} bytes", field="body")
            err.close = True  # type: ignore[attr-defined]
            raise err
        if ticket is not None and size * factor > ticket.held:  # no Content-Length: count as read
            try:
                ticket.hold(size * factor, "body")
            except OverloadedError as err:
                err.close = True  # type: ignore[attr-defined]  # the rest of the body is unread
                raise
        chunks.append(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def body_too_large(declared: str, limit: int) -> PayloadTooLargeError:
    """413 for a declared Content-Length past ``limit``; the connection is closed after
    it (its body is left unread)."""
    err = PayloadTooLargeError(
        f"body of {declared} bytes exceeds the limit of {limit} bytes", field="body"
    )
    err.close = True  # type: ignore[attr-defined]  # the unread body makes the connection unusable
    return err


def body_limit(service: Service, content_type: str | None) -> tuple[int, int, bool]:
    """``(most bytes, decode factor, binary)`` for an operator body of ``content_type``."""
    settings = service.settings
    if content_type is not None and codec.BINARY_TYPE in content_type.lower():
        return settings.max_body_bytes, DECODE_FACTOR["binary"], True
    # JSON holds ~16x its size while decoding: a lower limit of its own
    return min(settings.max_body_bytes, settings.max_json_body_bytes), DECODE_FACTOR["json"], False


async def decode_operator(request: Request, op: OperatorSpec) -> tuple[OperatorRequest, str, int]:
    """``(request, response encoding, body size)`` of ``POST /{op}``."""
    content_type, accept, length, declared = wire_headers(request.scope)
    service = service_of(request)
    limit, factor, binary_body = body_limit(service, content_type)
    ticket = None
    if declared is None or not declared.isdigit() or int(declared) > LARGE_BYTES:
        # a large (or unsized) body: held in the in-flight budget until the call ends
        ticket = request.scope["dxserve.ticket"] = hold_declared(service, declared, limit, factor)
    body = await read_body(request, limit, declared, ticket, factor)
    encoding = response_encoding(content_type, accept, body)
    parsed = await decode_body(body, content_type, length, op, binary_body)
    if ticket is not None:
        ticket.hold(len(body))  # decoded: the inputs take about the body's size
    return parsed, encoding, len(body)


def hold_declared(service: Service, declared: str | None, limit: int, factor: int) -> Ticket:
    """A ticket in the in-flight budget for a large (or unsized) body, holding what a
    declared length within ``limit`` takes to decode (503 past the budget, and the
    connection closed: the body is left unread)."""
    ticket = Ticket(service.budget)
    if declared is not None and declared.isdigit() and int(declared) <= limit:
        try:
            ticket.hold(int(declared) * factor, "body")
        except OverloadedError as err:
            err.close = True  # type: ignore[attr-defined]
            raise
    return ticket


async def decode_body(
    body: bytes, content_type: str | None, length: str | None, op: OperatorSpec, binary_body: bool
) -> OperatorRequest:
    """``decode_operator_request``, off the event loop for a large body that takes long."""
    if len(body) > LARGE_BYTES and not _decodes_quickly(body, binary_body, length):
        return await run_in_threadpool(decode_operator_request, body, content_type, length, op)
    return decode_operator_request(body, content_type, length, op)


def _decodes_quickly(body: bytes, binary_body: bool, header_length: str | None) -> bool:
    if binary_body:  # a small header: the arrays are views of the body
        return binary.decodes_as_views(header_length)
    return len(body) <= B64_INLINE_BYTES and codec.parsed_bytes(body) <= LARGE_BYTES


async def compute_request(
    request: Request, op: OperatorSpec
) -> tuple[Service, OperatorRequest, str, int]:
    """The service and the decoded request of ``POST /{op}`` or ``/prepare/{op}``, once the
    caller is authorized to compute (the token is only read when the server asks for one)."""
    service = service_of(request)
    if service.settings.require_token_for_compute:
        authorize(request, "compute")
    return (service, *await decode_operator(request, op))


def release_ticket(request: Request) -> None:
    """Give back what ``decode_operator`` held for a large body (once the call is over)."""
    ticket = request.scope.get("dxserve.ticket")
    if ticket is not None:
        ticket.release()


async def encode(
    payload: dict, encoding: str, status: int = 200, budget: InFlight | None = None
) -> Response:
    """The response; a large result is held in ``budget`` (with what encoding it
    takes) until it has been sent."""
    nbytes = result_nbytes(payload)
    if nbytes > LARGE_BYTES:  # sent as parts: see responses.PartsResponse
        held = 0
        if budget is not None:  # the result exists already: counted, never refused
            held = nbytes * (1 + ENCODE_FACTOR.get(encoding, 3))
            budget.force(held)
        try:
            if (
                encoding == "binary" and binary.encodes_as_views(payload)  # no copies
                or encoding == "b64" and nbytes <= B64_INLINE_BYTES * 3 // 4  # 4/3 in text
            ):
                parts, media, headers = codec.encode_body_parts(payload, encoding)
            else:
                parts, media, headers = await run_in_threadpool(
                    codec.encode_body_parts, payload, encoding
                )
        except BaseException:
            if budget is not None:
                budget.give(held)
            raise
        response = PartsResponse(parts, status, headers, media_type=media)
        if budget is not None:
            response.on_sent = lambda: budget.give(held)
        return response
    body, media, headers = codec.encode_body(payload, encoding)
    return BodyResponse(body, status, media, headers)


class OperatorEndpoint:
    """``POST /{operator}``: the operator's results, named after it."""

    def __init__(self, op: OperatorSpec) -> None:
        self.op = op
        self.__name__ = op.name
        takes = " and `tangents` (a list)" if op.takes_tangents else ""
        self.__doc__ = (
            f"`{op.name}` of a registered function at `x`{takes}. "
            f"Returns {', '.join(f'`{r}`' for r in op.results)}. Arrays may be JSON lists, "
            "typed base64 objects, or the binary framing (`application/vnd.dxserve.binary`)."
        )

    async def __call__(self, request: Request) -> Response:
        accept = wants_stream(request.scope)
        if accept is not None:  # Accept: text/event-stream (see streaming.py)
            return await self._stream(request, accept)
        try:
            service, req, encoding, size = await compute_request(request, self.op)
            results = await self._results(service, req, size, request.receive)
        finally:
            release_ticket(request)
        return await self._answer(service, results, encoding)

    async def answer(self, service: Service, scope: dict, receive: Receive) -> Response:
        """What ``__call__`` answers, for the protocol's operator lane (see ``lane``),
        without a ``Request``: the body is the first message ``receive`` gives. A
        body past ``LARGE_BYTES`` is held in the in-flight budget from its declared
        length until the call ends, as ``decode_operator`` holds it. Never an event
        stream."""
        content_type, accept, length, declared = wire_headers(scope)
        if declared is None or not declared.isdigit():  # the lane takes sized bodies only
            return await self(Request(scope, receive))
        if service.settings.require_token_for_compute:
            service.authorize(bearer_token_of(scope["headers"]), "compute")
        limit, factor, binary_body = body_limit(service, content_type)
        size = int(declared)
        if size > limit:
            raise body_too_large(declared, limit)
        ticket = hold_declared(service, declared, limit, factor) if size > LARGE_BYTES else None
        try:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            body = message["body"]
            encoding = response_encoding(content_type, accept, body)
            req = await decode_body(body, content_type, length, self.op, binary_body)
            if ticket is not None:
                ticket.hold(len(body))  # decoded: the inputs take about the body's size
            results = await self._results(service, req, len(body), receive, scope.get(LOOP))
        finally:
            if ticket is not None:
                ticket.release()
        return await self._answer(service, results, encoding)

    async def _results(
        self, service: Service, req: OperatorRequest, size: int, receive: Receive,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> dict | None:
        """The call's results; None if the client went away first. ``loop``: the
        running event loop, if the caller knows it."""
        job = Job()  # a chunked computation stops early if the client goes away
        watch = DisconnectWatch(receive, job)
        job.listen(loop or asyncio.get_running_loop(), watch)
        try:
            return await service.call(
                self.op.name, req.function, req.backend, req.x, req.tangents, req.contexts,
                req.prep, signature=req.signature, hint=size, batch_axis=req.batch_axis,
                job=job,
            )
        except JobCancelled:
            return None
        finally:
            watch.close()

    async def _answer(self, service: Service, results: dict | None, encoding: str) -> Response:
        if results is None:  # the client has gone: nobody to answer (499, as nginx logs it)
            return Response(status_code=499)
        return await encode(results_to_wire(results, self.op), encoding, budget=service.budget)

    async def _stream(self, request: Request, accept: str) -> Response:
        try:
            service, req, _, size = await compute_request(request, self.op)
        except BaseException:
            release_ticket(request)
            raise
        return EventStream(  # type: ignore[return-value]  # an ASGI response of its own
            service, self.op, req, size, accept, on_end=lambda: release_ticket(request)
        )


class PrepareEndpoint:
    """``POST /prepare/{operator}``: compile once; a handle to pass as ``prep``."""

    def __init__(self, op: OperatorSpec) -> None:
        self.op = op
        self.__name__ = f"prepare_{op.name}"
        self.__doc__ = f"Compile `{op.name}` once for this signature; returns a handle."

    async def __call__(self, request: Request) -> Response:
        try:
            service, req, _, _ = await compute_request(request, self.op)
            handle = await service.prepare(
                self.op.name, req.function, req.backend, req.x, req.tangents, req.contexts,
                batch_axis=req.batch_axis,
            )
        finally:
            release_ticket(request)
        return JSONResponse(handle)


async def list_functions(request: Request) -> dict:
    """Every registered function with its kind, signature and description."""
    return {"functions": service_of(request).functions()}


async def get_function(name: str, request: Request) -> dict:
    """One function's kind, signature and description."""
    return service_of(request).function(name)


async def register_function(request: Request) -> Response:
    """Register an expression or an uploaded JAX export (token needed if configured)."""
    authorize(request, "write")
    media = (request.headers.get("content-type") or "").split(";")[0].strip().lower()
    if media != codec.JSON_TYPE:
        raise UnsupportedMediaTypeError(
            f"POST /functions takes {codec.JSON_TYPE}, got {media or 'nothing'}",
            field="Content-Type",
        )
    service = service_of(request)
    body = await read_body(request, service.settings.max_upload_bytes)
    raw = codec.loads(body, field="body")
    if not isinstance(raw, dict):
        raise MalformedRequestError("the body must be a JSON object", field="body")
    described, created = await service.register(raw)
    return JSONResponse(described, 201 if created else 200)


async def delete_function(name: str, request: Request) -> dict:
    """Remove a registered expression or export (token needed if configured)."""
    authorize(request, "write")
    return {"deleted": await service_of(request).delete(name)}


async def list_backends(request: Request) -> dict:
    """Every backend type, its parameters, and the operators it serves."""
    return {"backends": service_of(request).backends()}


async def health() -> dict:
    """Liveness: answers from the event loop even while workers compute."""
    return {"status": "ok"}


async def ready(request: Request) -> dict:
    """Readiness plus what this server runs on."""
    return service_of(request).ready()


async def prometheus(request: Request) -> Response:
    """Prometheus text exposition."""
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
