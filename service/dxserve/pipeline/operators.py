"""One operator request, from its head and body to its answer, for every front door.

    call = OperatorCall(service, op, head)   # authorized, body limit, admitted
    with call.ticket:                        # given back on every exit path
        body = BodyBuffer(call)              # the door adds the body as it arrives
        ...
        req = await call.decode(body.take())  # a validated OperatorRequest
        results = await call.run(req, job)    # the Service, with progress and cancellation
        answer = await call.encode(results)   # an Answer: media type, headers, body parts

The HTTP app drives it for plain and event-stream answers, the Ray handle with values
instead of a body (``parse``), a test with neither. Limits, budgets, errors and progress
are therefore the same whichever door a request came through. Nothing here knows a web
framework: a door hands in a ``RequestHead`` and gets back ``Answer``s and ``DxError``s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from dxcontract import codec
from dxcontract.encodings import ENCODINGS, binary, costs_of
from dxcontract.encodings.negotiation import decoder_for, response_encoding
from dxcontract.errors import MalformedRequestError, PayloadTooLargeError
from dxcontract.operators import OPERATORS, OperatorSpec
from dxserve.core.progress import Job, JobCancelled
from dxserve.pipeline.wire import (
    OperatorRequest,
    WireMemo,
    decode_operator_request,
    parse_operator_request,
    result_nbytes,
    results_to_wire,
)
from dxserve.server.admission import SMALL_BYTES
from dxserve.server.answers import Answer
from dxserve.server.service import Service

#: A JSON body up to this size whose arrays are long base64 strings decodes (and such
#: an answer encodes) quickly enough for the event loop: ~0.1 ms per MB.
B64_INLINE_BYTES = 16 * 1024 * 1024
#: Bodies declaring at least this many bytes are received into one buffer of their size.
ONE_BUFFER_BYTES = 64 * 1024


@dataclass(slots=True)
class RequestHead:
    """What a door knows of a request before its body."""

    content_type: str | None = None
    accept: str | None = None
    #: the binary framing's JSON header length (``Dxserve-Header-Length``)
    header_length: str | None = None
    #: the declared body size; None when the request declares none
    content_length: int | None = None
    #: the bearer token presented ("" for another scheme, None for none)
    token: str | None = None


class OperatorCall:
    """One request for ``op`` (see the module). Creating it authorizes the caller (when
    the server asks a token for computing), picks the body's limit from its media type
    (415 for one no encoding reads), refuses a declared length past it (413) and holds
    what that body takes to decode in the budget (503 past it); nothing of the body has
    been read yet when these are raised."""

    def __init__(
        self, service: Service, op: OperatorSpec, head: RequestHead, memo: WireMemo | None = None,
        *, authorized: bool = False,
    ) -> None:
        self.service, self.op, self.head, self.memo = service, op, head, memo
        settings = service.settings
        # ``authorized``: a detached job's run, whose caller was authorized at submission
        if settings.require_token_for_compute and not authorized:
            service.authorize(head.token, "compute")
        costs = costs_of(decoder_for(head.content_type))  # what its encoding declares
        #: its arrays are views of the body: a buffer aligned for the device pays
        self.views = costs.views
        self.limit = min(settings.max_body_bytes, getattr(settings, costs.body_limit))
        self.decode_factor = costs.decode_factor
        declared = head.content_length
        if declared is not None and declared > self.limit:
            raise PayloadTooLargeError(
                f"body of {declared} bytes exceeds the limit of {self.limit} bytes", field="body"
            )
        self.ticket = service.budget.ticket()
        if declared is not None:
            self.ticket.hold_body(declared * self.decode_factor)
        #: the answer's encoding, known once the body is decoded
        self.encoding = "json"
        self.size = 0

    # --- the body ----------------------------------------------------------------
    async def decode(self, body: bytes | bytearray | memoryview) -> OperatorRequest:
        """The validated request in ``body`` (400/413/415/422 naming the field)."""
        head = self.head
        self.size = len(body)
        self.encoding = response_encoding(head.content_type, head.accept, body)
        self.ticket.encode_factor = costs_of(ENCODINGS[self.encoding]).encode_factor
        if len(body) > SMALL_BYTES and not decodes_quickly(body, self.views, head.header_length):
            req = await asyncio.to_thread(
                decode_operator_request, body, head.content_type, head.header_length, self.op,
                self.memo,
            )
        else:
            req = decode_operator_request(
                body, head.content_type, head.header_length, self.op, self.memo
            )
        self.ticket.hold_body(len(body))  # decoded: the inputs take about the body's size
        return req

    def parse(self, message: dict) -> OperatorRequest:
        """The validated request in ``message``, a request object of values already in
        memory (a door without a body, such as the Ray handle); its inputs are held in
        the budget as a body of their size would be."""
        req = parse_operator_request(message, self.op)
        self.ticket.hold_body(result_nbytes(message))
        return req

    # --- the computation ------------------------------------------------------------
    async def run(
        self, req: OperatorRequest, job: Job | None = None, *, timeout: float | None = None,
        entry: Any = None,
    ) -> dict[str, Any] | None:
        """``{result name: value}`` from the ``Service``; None if ``job`` was cancelled
        (its client went away). ``timeout``: seconds before 504 (the service's default).
        ``entry``: the function's version to run (a registry entry; None: the current)."""
        try:
            return await self.service.call(
                self.op.name, req.function, req.backend, req.x, req.tangents, req.contexts,
                req.prep, signature=req.signature, hint=self.size, batch_axis=req.batch_axis,
                has_aux=req.has_aux, wrt=req.wrt, cotangent=req.cotangent, job=job,
                timeout=timeout, ticket=self.ticket, entry=entry, holomorphic=req.holomorphic,
            )
        except JobCancelled:
            return None

    async def prepare(self, req: OperatorRequest) -> dict[str, Any]:
        """``POST /prepare/{op}``'s answer: a handle to pass as ``prep``."""
        return await self.service.prepare(
            self.op.name, req.function, req.backend, req.x, req.tangents, req.contexts,
            batch_axis=req.batch_axis, has_aux=req.has_aux, holomorphic=req.holomorphic,
            wrt=req.wrt, cotangent=req.cotangent,
        )

    # --- the answer -------------------------------------------------------------------
    async def encode(self, results: dict[str, Any], encoding: str | None = None) -> Answer:
        """``results`` in the answer's encoding (``encoding``: another one), as consecutive
        parts (a large binary answer: the arrays' own memory); large ones are encoded off
        the event loop when that takes long."""
        encoding = encoding or self.encoding
        payload = results_to_wire(results, self.op)
        nbytes = result_nbytes(payload)
        if nbytes <= SMALL_BYTES:
            body, media, headers = codec.encode_body(payload, encoding)
            return Answer(media, [body], len(body), headers)
        if (
            encoding == "binary" and binary.encodes_as_views(payload)  # no copies
            or encoding == "b64" and nbytes <= B64_INLINE_BYTES * 3 // 4  # 4/3 in text
        ):
            parts, media, headers = codec.encode_body_parts(payload, encoding)
        else:
            parts, media, headers = await asyncio.to_thread(
                codec.encode_body_parts, payload, encoding
            )
        parts = byte_parts(parts)
        return Answer(media, parts, sum(len(p) for p in parts), headers)


def decodes_quickly(
    body: bytes | bytearray | memoryview, binary_body: bool, header_length: str | None
) -> bool:
    """Does decoding ``body`` take no longer than a small one? A binary body with a small
    header (views of itself), or a JSON body whose arrays are long base64 strings
    (lifted out before parsing), up to ``B64_INLINE_BYTES``."""
    if binary_body:
        return binary.decodes_as_views(header_length)
    return len(body) <= B64_INLINE_BYTES and codec.parsed_bytes(body) <= SMALL_BYTES


def byte_parts(parts: list[Any]) -> list[Any]:
    """``parts`` as flat byte views (``len`` counts bytes), empty ones dropped."""
    views = (part if isinstance(part, bytes) else _byte_view(part) for part in parts)
    return [view for view in views if len(view)]


def _byte_view(part: Any) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class BodyBuffer:
    """A request body as its door receives it, within the call's limit.

    A body declaring at least ``ONE_BUFFER_BYTES`` is received into one buffer of its
    declared size, allocated when its first bytes arrive; for the binary framing it is
    64-byte aligned, so the arrays decoded from it (views at 64-byte offsets) are used
    by the device as they are. Smaller bodies are kept as received (usually one piece).
    A body without a declared length is held in the budget as it grows.
    """

    __slots__ = ("call", "declared", "got", "pieces", "buffer")

    def __init__(self, call: OperatorCall) -> None:
        self.call = call
        self.declared = call.head.content_length
        self.got = 0
        self.pieces: list[bytes] = []
        self.buffer: Any = None

    def add(self, data: bytes) -> None:
        """``data``, the next bytes of the body (413 past the limit, 400 past the
        declared length)."""
        if not data:
            return
        end = self.got + len(data)
        call = self.call
        if end > call.limit:
            raise PayloadTooLargeError(
                f"body exceeds the limit of {call.limit} bytes", field="body"
            )
        declared = self.declared
        if declared is None:
            call.ticket.hold_body(end * call.decode_factor)
        elif end > declared:
            raise MalformedRequestError(
                f"the body is longer than its Content-Length of {declared}", field="body"
            )
        elif declared >= ONE_BUFFER_BYTES:
            if self.buffer is None:
                if end == declared and _fits(data, call.views):  # whole, in one piece
                    self.buffer, self.got = data, end  # (a server that received it so)
                    return
                self.buffer = aligned_buffer(declared) if call.views else bytearray(declared)
            self.buffer[self.got:end] = data
            self.got = end
            return
        self.pieces.append(data)
        self.got = end

    def take(self) -> bytes | bytearray | memoryview:
        """The whole body (the declared length must have arrived: 400 otherwise)."""
        if self.declared is not None and self.got != self.declared:
            raise MalformedRequestError(
                f"the body ended after {self.got} of its {self.declared} bytes", field="body"
            )
        if self.buffer is not None:
            return self.buffer
        pieces = self.pieces
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)



def stored_calls(service: Service) -> Callable[[str, str | None, str | None, int], OperatorCall]:
    """What a job runner (``server.jobs.detached.Detached``) runs a stored request with,
    as ``POST /{operator}`` would: ``(operator name, content type, binary header length,
    body length) -> OperatorCall`` on ``service``, authorized (its caller was, when it
    submitted the job)."""

    def open_call(
        operator: str, content_type: str | None, header_length: str | None, length: int
    ) -> OperatorCall:
        head = RequestHead(content_type, None, header_length, length, None)
        return OperatorCall(service, OPERATORS[operator], head, authorized=True)

    return open_call

def _fits(data: Any, views: bool) -> bool:
    """Can ``data`` (a whole body) be kept as it is: 64-byte aligned where its arrays
    will be views?"""
    if not views:
        return isinstance(data, bytes | bytearray | memoryview)
    return isinstance(data, memoryview) and np.frombuffer(data, np.uint8).ctypes.data % 64 == 0


def aligned_buffer(size: int, align: int = 64) -> memoryview:
    """A writable ``size``-byte buffer whose first byte is ``align``-byte aligned.

    Not zeroed (a body is received into all of it before it is read): a ``bytearray``
    would write every byte once more, 8 MB at n = 10^6."""
    raw = np.empty(size + align - 1, np.uint8)
    start = -raw.ctypes.data % align
    return memoryview(raw)[start:start + size]
