"""The operator endpoints: ``POST /{operator}`` and ``POST /prepare/{operator}``.

Each is a plain ASGI endpoint over the request layer (``pipeline``): it reads the
request's head and body off the connection, hands them to an ``OperatorCall`` and
writes its ``Answer``. Errors are raised, and the app's exception handlers answer
them (``problems``); an error raised before the body was read in full also closes the
connection, since the rest of the body is never read.
"""

from __future__ import annotations

import asyncio
from typing import Any

from starlette.requests import ClientDisconnect, Request
from starlette.types import Receive, Scope, Send

from dxcontract import codec
from dxcontract.errors import PayloadTooLargeError
from dxcontract.operators import OperatorSpec
from dxserve.core.progress import Job
from dxserve.http.protocol import BODY_SINK
from dxserve.http.sending import cover
from dxserve.http.streaming import DisconnectWatch, EventStream
from dxserve.pipeline import Answer, BodyBuffer, OperatorCall, RequestHead, WireMemo
from dxserve.server.admission import SMALL_BYTES
from dxserve.server.service import Service

_HEAD_FIELDS = {
    name: at for at, name in enumerate((
        b"content-type", b"accept", codec.HEADER_LENGTH.lower().encode(), b"content-length",
        b"authorization",
    ))
}


def request_head(headers: list[tuple[bytes, bytes]]) -> RequestHead:
    """The ``RequestHead`` of an ASGI request's headers (the first of each, in one pass)."""
    found: list[bytes | None] = [None] * len(_HEAD_FIELDS)
    for name, value in headers:
        at = _HEAD_FIELDS.get(name)
        if at is not None and found[at] is None:
            found[at] = value
    content_type, accept, header_length, length, authorization = found
    return RequestHead(
        content_type.decode("latin-1") if content_type is not None else None,
        accept.decode("latin-1") if accept is not None else None,
        header_length.decode("latin-1") if header_length is not None else None,
        int(length) if length is not None and length.isdigit() and len(length) < 19 else None,
        bearer_token(authorization),
    )


def bearer_token(authorization: bytes | None) -> str | None:
    """The bearer token of an ``Authorization`` header ("" for another scheme), None
    without the header."""
    if authorization is None:
        return None
    scheme, _, token = authorization.decode("latin-1").partition(" ")
    return token if scheme.lower() == "bearer" else ""


def wants_stream(head: RequestHead) -> bool:
    """Does the request ask for an event stream (``Accept: text/event-stream``)?"""
    return head.accept is not None and "text/event-stream" in head.accept


#: An error answered before the body was read leaves a declared body up to this size to be
#: read and dropped, so the connection stays usable; a larger one closes it.
DRAIN_BYTES = 64 * 1024


async def admit(
    scope: Scope, receive: Receive, service: Service, op: OperatorSpec, head: RequestHead,
    memo: WireMemo | None = None,
) -> OperatorCall:
    """The request's ``OperatorCall`` (authorized, limited and admitted: see it)."""
    try:
        return OperatorCall(service, op, head, memo)
    except Exception as exc:
        await drop_body(scope, receive, head, exc)
        raise


async def drop_body(scope: Scope, receive: Receive, head: RequestHead, error: Exception) -> None:
    """Before ``error`` is answered with the body unread: read and drop a small body, or
    close the connection after the answer (always for a body refused for its size)."""
    if (
        isinstance(error, PayloadTooLargeError)
        or head.content_length is None or head.content_length > DRAIN_BYTES
    ):
        close_after_answer(scope)
        return
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        more = message.get("more_body", False)


async def read_body(scope: Scope, receive: Receive, call: OperatorCall) -> Any:
    """The request's whole body, received into ``call``'s ``BodyBuffer`` (straight from the
    connection where it offers a ``BODY_SINK``: the body's declared length is admitted)."""
    body = BodyBuffer(call)
    sink = scope.get(BODY_SINK)
    if sink is not None and body.declared is not None:
        sink(body.add)
    more = True
    try:
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            body.add(message.get("body", b""))
            more = message.get("more_body", False)
        return body.take()
    except Exception:
        close_after_answer(scope)
        raise


def close_after_answer(scope: Scope) -> None:
    """Close the connection once the error is answered: the rest of the body is never read
    (see ``problems``)."""
    Request(scope).state.close_connection = True


async def send_answer(send: Send, answer: Answer) -> None:
    """Write ``answer``: its head, then its parts. A large answer ends with an empty
    message, which the server sends only once the client has taken all but a little of
    what was written: until then the answer's bytes stay held in the budget."""
    headers = [
        (b"content-type", answer.media_type.encode("latin-1")),
        (b"content-length", b"%d" % answer.nbytes),
        *((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in answer.headers.items()),
    ]
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    parts = answer.parts
    if answer.nbytes <= SMALL_BYTES:
        await send({"type": "http.response.body", "body": b"".join(parts) if len(parts) != 1
                    else parts[0]})
        return
    for part in parts:
        await send({"type": "http.response.body", "body": part, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


#: The answer to a client that went away before it: nobody reads it (nginx logs 499).
GONE = Answer("text/plain", [], 0, status=499)


class OperatorEndpoint:
    """``POST /{operator}``: the operator's results, named after it. ``memo``: the
    requests this app has validated (one per app, shared by its endpoints)."""

    def __init__(self, service: Service, op: OperatorSpec, memo: WireMemo | None = None) -> None:
        self.service, self.op, self.memo = service, op, memo

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        head = request_head(scope["headers"])
        call = await admit(scope, receive, self.service, self.op, head, self.memo)
        cover(scope, call.ticket)  # the answer's bytes are the result's, reserved already
        with call.ticket:
            if wants_stream(head):
                body = await read_body(scope, receive, call)
                stream = EventStream(call, await call.decode(body), head.accept or "")
                await stream(scope, receive, send)
                return
            req = await call.decode(await read_body(scope, receive, call))
            job = Job()  # a chunked computation stops early if the client goes away
            watch = DisconnectWatch(receive, job)
            job.listen(asyncio.get_running_loop(), watch)
            try:
                results = await call.run(req, job)
            finally:
                watch.close()
            answer = GONE if results is None else await call.encode(results)
            await send_answer(send, answer)


class PrepareEndpoint:
    """``POST /prepare/{operator}``: compile once; a handle to pass as ``prep``."""

    def __init__(self, service: Service, op: OperatorSpec) -> None:
        self.service, self.op = service, op

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        head = request_head(scope["headers"])
        call = await admit(scope, receive, self.service, self.op, head)
        with call.ticket:
            req = await call.decode(await read_body(scope, receive, call))
            handle = await call.prepare(req)
        body = codec.dumps(handle)
        await send_answer(send, Answer(codec.JSON_TYPE, [body], len(body)))
