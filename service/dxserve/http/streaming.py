"""Progress streams and cancellation of operator requests.

``POST /{operator}`` with ``Accept: text/event-stream`` is answered by an
``EventStream``: Server-Sent Events while the computation runs, then its answer.

    event: progress
    data: {"done": 400, "total": 2000, "unit": "columns"}

    event: result
    data: {"hessian": [[...], ...]}

* ``progress`` after every chunk of a chunked computation (see ``chunking``) and
  repeated at least every ``HEARTBEAT`` seconds; ``unit`` is "columns", "rows",
  "points" or "tangents". A computation that runs in one piece sends none.
* ``: keep-alive`` comments every ``HEARTBEAT`` seconds while there is no progress to
  tell (compiling, queued), so proxies keep the connection open.
* one final ``result`` whose data is exactly the route's JSON answer (arrays as lists,
  or typed base64 with ``Accept: text/event-stream; arrays=b64``), or one ``error``
  whose data is the problem+json document (its ``status`` the HTTP status the plain
  request would have had).

Closing the connection cancels the computation at its next chunk boundary
(``Job.cancel``), as does the stream's own deadline (``DXSERVE_STREAM_TIMEOUT``).
``DisconnectWatch`` does the same for a plain request, and costs nothing until its
computation turns out to run in chunks (only then can it stop early).
"""

from __future__ import annotations

import asyncio
import logging

from starlette.types import Receive, Scope, Send

from dxcontract import codec
from dxcontract.errors import DeadlineExceededError, DxError
from dxserve.core.progress import Job
from dxserve.http.problems import problem_document
from dxserve.pipeline import OperatorCall, OperatorRequest

log = logging.getLogger("dxserve.http")

EVENT_STREAM = "text/event-stream"
#: Seconds between progress repeats or keep-alive comments on a quiet stream.
HEARTBEAT = 1.0


def event(name: str, data: bytes) -> bytes:
    """One SSE event; ``data`` is one line of JSON."""
    return b"event: " + name.encode() + b"\ndata: " + data + b"\n\n"


class EventStream:
    """An ASGI response: the progress of ``call`` running ``req``, then its answer."""

    def __init__(self, call: OperatorCall, req: OperatorRequest, accept: str) -> None:
        self.call, self.req = call, req
        self.encoding = "b64" if "arrays=b64" in accept.lower() else "json"
        self.status_code = 200

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        job = Job(streams=True)
        job.listen(loop, wake.set)
        call = self.call
        task = loop.create_task(
            call.run(self.req, job, timeout=call.service.settings.stream_timeout)
        )
        gone = loop.create_task(_disconnected(receive))
        task.add_done_callback(lambda _: wake.set())
        gone.add_done_callback(lambda _: wake.set())
        try:
            await send({
                "type": "http.response.start", "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    (b"x-accel-buffering", b"no"),  # nginx: pass events on at once
                ],
            })
            sent = 0  # reports sent: every chunk boundary gets its event
            last = loop.time()
            while not task.done():
                try:
                    await asyncio.wait_for(wake.wait(), HEARTBEAT)
                except TimeoutError:
                    pass
                wake.clear()
                if gone.done():  # the client went away: stop the work, say nothing more
                    job.cancel()
                    task.cancel()
                    return
                now = loop.time()
                if len(job.reports) > sent:
                    sent = await _send_reports(send, job, sent)
                    last = now
                elif now - last >= HEARTBEAT:  # the latest again, or a comment before any
                    await send(_body(
                        _progress(job, job.done) if job.total is not None
                        else b": keep-alive\n\n"
                    ))
                    last = now
            await _send_reports(send, job, sent)  # the last chunks', before the answer
            await send(_body(await self._outcome(task)))
            # sent once the client took all but a little: held in the budget until then
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            gone.cancel()
            if not task.done():
                job.cancel()
                task.cancel()

    async def _outcome(self, task: asyncio.Task) -> bytes:
        """The final ``result`` or ``error`` event of a finished computation."""
        try:
            results = task.result()
        except DxError as exc:
            return event("error", codec.dumps(problem_document(exc)))
        except Exception as exc:  # noqa: BLE001 - the stream says so; the server goes on
            log.exception("operator %s failed in a stream", self.call.op.name)
            return event("error", codec.dumps({
                "type": "about:blank", "title": "Internal Server Error", "status": 500,
                "detail": f"{type(exc).__name__}: the computation failed unexpectedly",
            }))
        if results is None:  # stopped at its deadline (the deadline's 504 came first)
            error = DeadlineExceededError("the computation was cancelled")
            return event("error", codec.dumps(problem_document(error)))
        try:
            answer = await self.call.encode(results, self.encoding)
        except DxError as exc:
            return event("error", codec.dumps(problem_document(exc)))
        return event("result", b"".join(answer.parts))


def _progress(job: Job, done: int) -> bytes:
    data = b'{"done":%d,"total":%d,"unit":"%s"}' % (done, job.total, job.unit.encode())
    return event("progress", data)


async def _send_reports(send: Send, job: Job, sent: int) -> int:
    """Send the progress reports after the first ``sent`` in one body message; the
    number sent now."""
    reports = job.reports[sent:]  # a copy: the worker may append meanwhile
    if reports:
        await send(_body(b"".join(_progress(job, done) for done in reports)))
    return sent + len(reports)


def _body(data: bytes) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": True}


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (the request's body has been read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class DisconnectWatch:
    """Cancel a plain request's job when its client disconnects.

    ``job.listen(loop, watch)``: called on the event loop when the computation turns
    chunked (and after each chunk); the first call starts one task waiting for the
    disconnect. ``close()`` when the call is over. A computation that never runs in
    chunks never starts the task.
    """

    __slots__ = ("receive", "job", "task")

    def __init__(self, receive: Receive, job: Job) -> None:
        self.receive, self.job, self.task = receive, job, None

    def __call__(self) -> None:
        if self.task is None and not self.job.cancelled:
            self.task = asyncio.ensure_future(self._watch())

    async def _watch(self) -> None:
        await _disconnected(self.receive)
        self.job.cancel()

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
