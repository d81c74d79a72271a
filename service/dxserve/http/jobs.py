"""The job endpoints: ``POST /jobs/{operator}``, ``GET /jobs``, ``GET`` and ``DELETE
/jobs/{id}``, ``GET /jobs/{id}/result`` and ``GET /jobs/{id}/events``.

Each parses the request, calls ``detached.Detached`` (found on ``app.state.detached``)
and encodes its answer; errors are raised for the app's handlers (``problems``). The
submission reads its body as ``POST /{operator}`` does (``operators``: the same limits,
encodings and validation), so a body is refused before anything is stored.

    event: progress
    data: {"done": 400, "total": 2000, "unit": "columns"}

    event: result
    data: {"hessian": [[...], ...]}

The events are a streamed operator's (``streaming``): progress as the job moves, then
one ``result`` (the result's JSON answer; typed base64 arrays with ``Accept:
text/event-stream; arrays=b64``) or one ``error`` (a problem document: the job failed,
was cancelled or removed). Closing the stream leaves the job running.
"""

from __future__ import annotations

import difflib
import json
import time
from typing import Any

from fastapi import Query, Request
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from dxcontract import codec
from dxcontract.errors import DxError
from dxcontract.operators import OPERATORS
from dxserve.http.operators import admit, bearer_token, read_body, request_head
from dxserve.http.problems import problem_document
from dxserve.http.sending import cover
from dxserve.http.streaming import EVENT_STREAM, HEARTBEAT, event
from dxserve.pipeline import WireMemo
from dxserve.server.jobs.detached import Detached, stored_error
from dxserve.server.service import Service


def detached_of(request: Request) -> Detached:
    return request.app.state.detached


def token_of(request: Request) -> str | None:
    authorization = request.headers.get("authorization")
    return bearer_token(authorization.encode("latin-1") if authorization is not None else None)


def with_status(doc: dict[str, Any]) -> dict[str, Any]:
    """A status document whose stored ``error`` becomes a whole problem document."""
    error = doc.get("error")
    if error is not None:
        doc["error"] = problem_document(stored_error(error))
    return doc


class JobSubmitEndpoint:
    """``POST /jobs/{operator}``: the operator's own body, stored as a queued job; 202
    with ``Location: /jobs/{id}`` and the job's status document."""

    def __init__(self, service: Service, detached: Detached, memo: WireMemo | None = None) -> None:
        self.service, self.detached, self.memo = service, detached, memo

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        name = scope.get("path_params", {}).get("operator", "")
        op = OPERATORS.get(name)
        if op is None:
            close = difflib.get_close_matches(name, list(OPERATORS), n=3, cutoff=0.6)
            guess = f"did you mean {' or '.join(close)}? " if close else ""
            raise HTTPException(
                404, f"no operator {name[:80]!r} to run as a job; {guess}POST /jobs/{{operator}} "
                "takes any operator's route name (see /docs)",
            )
        head = request_head(scope["headers"])
        call = await admit(scope, receive, self.service, op, head, self.memo)
        with call.ticket:
            body = await read_body(scope, receive, call)
            req = await call.decode(body)
            doc = await self.detached.submit(call, req, body)
        location = f"{scope.get('root_path', '')}/jobs/{doc['id']}"
        response = JSONResponse(with_status(doc), 202, {"location": location})
        await response(scope, receive, send)


async def list_jobs(
    request: Request,
    limit: int = Query(20, ge=1, le=100, description="Most jobs on this page"),
    after: str | None = Query(None, max_length=512, description="The previous page's `next`"),
) -> Response:
    """Your jobs (those of the bearer token you send), newest first, a page at a time."""
    found = await detached_of(request).list(token_of(request), limit, after)
    found["jobs"] = [with_status(doc) for doc in found["jobs"]]
    return JSONResponse(found)


async def get_job(job_id: str, request: Request) -> Response:
    """A job's status, progress and timings, and its problem document if it failed."""
    return JSONResponse(with_status(await detached_of(request).status(job_id, token_of(request))))


async def get_job_result(job_id: str, request: Request) -> Response:
    """The job's answer, in the encoding asked for (`Accept`) as its operator's answer
    would be; 409 with `Retry-After` until it has ended. A failed job answers with its
    own problem document."""
    detached = detached_of(request)
    ticket = detached.service.budget.ticket()
    try:
        answer = await detached.result(
            job_id, token_of(request), request.headers.get("accept"), ticket
        )
    except BaseException:
        ticket.release()
        raise
    # held until the client has taken the answer, or is cut off (see ``sending``)
    cover(request.scope, ticket)
    return Response(b"".join(answer.parts), answer.status, answer.headers,
                    media_type=answer.media_type)


async def delete_job(job_id: str, request: Request) -> Response:
    """Cancel a queued or running job (202 with its status: a running one stops at its
    next chunk); remove an ended one and its result (204)."""
    removed, doc = await detached_of(request).cancel(job_id, token_of(request))
    if removed:
        return Response(status_code=204)
    return JSONResponse(with_status(doc or {}), 202)


async def job_events(job_id: str, request: Request) -> Response:
    """Server-Sent Events of a job: progress, then its result or error (see the module).
    Closing the stream does not cancel the job."""
    detached, token = detached_of(request), token_of(request)
    events = await detached.follow(job_id, token)  # 404 and 429 before the stream starts
    arrays = "b64" if "arrays=b64" in (request.headers.get("accept") or "").lower() else "lists"
    return StreamingResponse(
        _events(detached, events, job_id, token, arrays, request.scope), media_type=EVENT_STREAM,
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
    )


async def _events(
    detached: Detached, events: Any, job_id: str, token: str | None, arrays: str, scope: Scope
) -> Any:
    last = time.monotonic()
    try:
        async for name, value in events:
            now = time.monotonic()
            if name == "progress":
                yield event("progress", json.dumps(value, separators=(",", ":")).encode())
                last = now
            elif name == "quiet" and now - last >= HEARTBEAT:
                yield b": keep-alive\n\n"
                last = now
            elif name == "ended":
                yield await _outcome(detached, job_id, token, arrays, scope)
                return
    except DxError as exc:  # removed meanwhile
        yield event("error", codec.dumps(problem_document(exc)))


async def _outcome(
    detached: Detached, job_id: str, token: str | None, arrays: str, scope: Scope
) -> bytes:
    """The final event; the result's bytes stay held until the stream has been taken
    in full (or its client is cut off): the send path releases the ticket."""
    ticket = detached.service.budget.ticket()
    try:
        answer = await detached.result(
            job_id, token, f"{codec.JSON_TYPE}; arrays={arrays}", ticket
        )
    except DxError as exc:
        ticket.release()
        return event("error", codec.dumps(problem_document(exc)))
    except BaseException:
        ticket.release()
        raise
    cover(scope, ticket)
    return event("result", b"".join(answer.parts))
