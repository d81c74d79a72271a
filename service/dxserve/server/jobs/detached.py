"""Detached jobs: operator requests that outlive their connection, their client and their
server process.

    detached = Detached(service, open_call=stored_calls(service))  # one per process
    detached.start()                                  # its runner: runs what is queued
    doc = await detached.submit(call, req, body)      # validated, stored, answered 202
    doc = await detached.status(job_id, token)        # status, progress, timings, error
    answer = await detached.result(job_id, token, accept)   # 409 until it has ended
    async for name, value in await detached.follow(job_id, token): ...
    removed, doc = await detached.cancel(job_id, token)

A door (the HTTP app) parses and encodes; everything else is here: who owns a job,
the limits, the records (in the store, ``stores.jobs``), and the runs. A job runs as
``POST /{operator}`` would (the request layer's call, handed in by the door as
``open_call``: its body decoded, its budgets the operator's), in whichever process
claims it from the store, under a lease renewed while it runs (``job_lease_seconds``);
a process that dies leaves its job to be taken over once the lease expires. A chunked run keeps every finished chunk in the store
(``jobs.Checkpoints``): a resumed run takes those back instead of computing them again,
so its result is the uninterrupted run's, bit for bit.

Ownership: a job belongs to the bearer token that submitted it (a digest of it is
stored, never the token); another token, or none, is told there is no such job (404).
With tokens configured, a token presented must be one of them (401).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import numpy as np

from dxcontract import codec
from dxcontract.encodings import ENCODINGS, costs_of
from dxcontract.encodings.common import LIST_MARKER, TUPLE_MARKER, SeqNode
from dxcontract.encodings.negotiation import response_encoding
from dxcontract.errors import (
    BudgetExceededError,
    DeadlineExceededError,
    DxError,
    InternalError,
    InvalidArgumentError,
    JobCancelledError,
    JobNotFinishedError,
    OverloadedError,
    RequestShapeError,
    ResultTooLargeError,
    StorageFullError,
    UnauthorizedError,
    UnknownFunctionError,
    UnknownJobError,
)
from dxserve.core.progress import Job, JobCancelled
from dxserve.frameworks import get_framework
from dxserve.server.admission import Ticket
from dxserve.server.answers import Answer
from dxserve.server.jobs.store import (
    ID_PATTERN,
    JobRecord,
    JobStore,
    counted,
    jobs_full,
    open_jobs,
    result_too_big,
)
from dxserve.server.jobs.watch import JobWatches, Watch
from dxserve.server.service import Service
from dxserve.server.stores.directory import StoredFunction, content_digest

if TYPE_CHECKING:  # the request layer above: its calls are handed in (``open_call``)
    from dxserve.pipeline import OperatorCall, OperatorRequest

log = logging.getLogger("dxserve.jobs")

#: Most jobs one ``GET /jobs`` page lists.
MAX_PAGE = 100
#: What a JSON request carrying base64 arrays looks like to negotiation (its answer
#: mirrors it), kept instead of the request body.
_B64_PROBE = b'"__ndarray__":"'
#: Bytes reserved for a result beyond its arrays: the binary encoding's header.
_RESULT_FRAMING = 64 * 1024
#: Seconds a runner waits after the server was too busy to take a job (503) before
#: claiming again.
_BUSY_BACKOFF = 1.0


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z"
    )


def error_fields(exc: DxError) -> dict[str, Any]:
    """A typed error as stored with a failed job: its problem document's fields without
    the HTTP status (the door adds it when it answers)."""
    fields: dict[str, Any] = {"type": exc.type, "title": exc.title, "detail": exc.json_detail()}
    if exc.field is not None:
        fields["field"] = exc.field
    if exc.fix:
        fields["fix"] = exc.fix
    fields.update({k: v for k, v in exc.extra.items() if _jsonable(v)})
    return fields


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def stored_error(fields: dict[str, Any]) -> DxError:
    """The typed error a failed job stored (``error_fields``), rebuilt."""
    return DxError.from_problem(500, dict(fields))


class _StoredJob(Job):
    """A detached job's ``Job``: its progress written to the store, its finished chunks
    kept there (``Checkpoints``), and stopped when its runner loses the lease.

    The store is written by the process's one job-writer thread, so the device worker
    computes the next chunk while the last one is written: a chunk's bytes are copied
    and handed over, with at most one write in flight (the worker waits for it before
    handing over the next). A kept chunk is reported once its write has committed, so
    a progress report always means the chunk survives a crash.
    """

    def __init__(self, detached: Detached, rec: JobRecord, kept: dict[str, bytes]) -> None:
        super().__init__(streams=True)  # never merged into a batch: its progress is its own
        self.detached, self.id = detached, rec.id
        self.kept = kept
        self.checkpoints = self
        #: the lease was taken over (or the job removed): another runner has it now
        self.lost = False
        #: handed back to the queue (this process is stopping)
        self.released = False
        self.taken = 0  # chunks taken back from checkpoints in this run
        self._restored = 0  # of those, not yet written to the record
        self._deferred: set[int] = set()  # reports that wait for their chunk's write
        self._pending: Future | None = None

    # --- Checkpoints (worker thread) ----------------------------------------------------
    def restore(self, key: str, shape: tuple, dtype: Any) -> Any:
        data = self.kept.pop(key, None)
        if data is None:
            return None
        block = np.frombuffer(data, np.dtype(dtype))
        if block.size != math.prod(shape):
            return None
        self._restored += 1
        self.taken += 1
        return block.reshape(shape)

    def save(self, key: str, block: Any, done: int) -> None:
        data = np.ascontiguousarray(block).tobytes()  # the block's buffer is reused next
        self.drain()
        self.check()  # the last write found the job no longer ours, or to stop
        self._deferred.add(done)
        self._pending = self.detached._writes.submit(self._save, key, data, done)

    # --- progress (worker thread) ---------------------------------------------------------
    def start(self, total: int, unit: str) -> None:
        super().start(total, unit)
        self._pending_progress(0)

    def report(self, done: int) -> None:
        if done in self._deferred:  # told once its chunk's write has committed
            self._deferred.discard(done)
        else:
            self._pending_progress(done)
            self.tell(done)
        self.between(done)

    def drain(self) -> None:
        """Wait for the write in flight (any thread)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _pending_progress(self, done: int) -> None:
        self.drain()
        self._pending = self.detached._writes.submit(self._progress, done)

    # --- the writer thread ----------------------------------------------------------------
    def _save(self, key: str, data: bytes, done: int) -> None:
        d = self.detached
        try:
            rec = d.store.checkpoint(self.id, d.runner, key, data, done, self.total or 0,
                                     self.unit or "")
        except Exception as exc:  # noqa: BLE001 - the store busy or full: not kept, told
            log.warning("job %s: checkpoint %s not kept: %s", self.id, key, exc)
        else:
            self._seen(rec)
        self.tell(done)

    def _progress(self, done: int) -> None:
        d, restored = self.detached, self._restored
        try:
            rec = d.store.progress(self.id, d.runner, done, self.total, self.unit, restored)
        except Exception as exc:  # noqa: BLE001 - progress is told anyway
            log.warning("job %s: progress not written: %s", self.id, exc)
            return
        self._restored -= restored
        self._seen(rec)

    def _seen(self, rec: JobRecord | None) -> None:
        """Stop if the store says the job is no longer this runner's, or is to stop."""
        if rec is None:
            self.lost = True
            self.cancel()
        elif rec.cancel_requested:
            self.cancel()


#: How the runner opens the request layer's call for a stored request: ``(operator name,
#: content type, binary header length, body length) -> call`` with ``ticket``,
#: ``decode``, ``run`` and ``encode`` (``pipeline.stored_calls``: an authorized
#: ``OperatorCall``). The door that owns the runner gives it: the layer is above this one.
OpenCall = Callable[[str, str | None, str | None, int], Any]


class Detached:
    """The detached jobs of one server process: the API its doors call, and the runner
    that claims and runs jobs from the store (see the module). ``open_call`` runs a
    job's request (``OpenCall``); without it, ``start`` refuses (a store's jobs can
    still be read, as a test of the records does)."""

    def __init__(
        self, service: Service, store: JobStore | None = None, *,
        open_call: OpenCall | None = None,
    ) -> None:
        self.service = service
        self.open_call = open_call
        self.settings = service.settings
        self.store = store if store is not None else open_jobs(service.store)
        #: this process's name in the store's leases
        self.runner = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        #: runs this process started, and chunks they took back from checkpoints
        self.runs = 0
        self.restored = 0
        self._tasks: dict[str, asyncio.Task] = {}
        self._jobs: dict[str, _StoredJob] = {}
        #: the shared watches of followed jobs (made with the first stream)
        self._job_watches: JobWatches | None = None
        self._wake: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._busy_until = 0.0
        self._tokens = bool(self.settings.tokens())  # read once, as the service reads them
        #: the one thread that writes running jobs' checkpoints and progress
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="dxserve-job-writes")

    # --- who asks ---------------------------------------------------------------------
    def owner(self, token: str | None) -> str:
        """The owner a caller's bearer token stands for ("" for none); 401 for a token
        that is not one of those configured (when tokens are). Without tokens configured
        every token is the anonymous owner: an invented token is nobody in particular,
        and must not open a quota of jobs of its own."""
        if token is not None and not self._tokens:
            token = None
        if token is None:
            if self.settings.require_token_for_compute:
                self.service.authorize(None, "compute")
            return ""
        if self._tokens and not self.service.accepts_token(token):
            raise UnauthorizedError(
                "send 'Authorization: Bearer <token>' with a valid token", field="Authorization"
            )
        return "t:" + hashlib.sha256(token.encode()).hexdigest()[:40]

    def _available(self) -> JobStore:
        if self.store is None:
            raise InvalidArgumentError(
                f"this server's store ({type(self.service.store).__name__}) keeps no jobs: "
                "serve with an SQLite, PostgreSQL or directory store (DXSERVE_STORE)",
                field="operator",
            )
        return self.store

    async def _mine(self, job_id: Any, token: str | None) -> JobRecord:
        """The caller's job ``job_id`` (404 for a bad id, another's job, or none)."""
        owner = self.owner(token)
        store = self._available()
        if not isinstance(job_id, str) or not ID_PATTERN.fullmatch(job_id):
            raise UnknownJobError(
                f"no job {str(job_id)[:80]!r}: a job id is what POST /jobs/{{operator}} "
                "answered (GET /jobs lists yours)", field="id",
            )
        rec = await asyncio.to_thread(store.get, job_id)
        if rec is None or rec.owner != owner or self._expired(rec, time.time()):
            raise UnknownJobError(
                f"no job {job_id!r} of yours: never made, removed, expired "
                "(DXSERVE_JOB_RESULT_TTL), or another token's; GET /jobs lists yours",
                field="id",
            )
        return rec

    def _expired(self, rec: JobRecord, now: float) -> bool:
        return rec.ended and rec.finished is not None and (
            rec.finished + self.settings.job_result_ttl < now
        )

    # --- the API ----------------------------------------------------------------------
    async def submit(
        self, call: OperatorCall, req: OperatorRequest, body: Any
    ) -> dict[str, Any]:
        """Store a validated request as a queued job; its status document. 429 past the
        token's jobs; 507 past the bytes the jobs may hold, counting what this one
        reserves: its body, its function's version and its expected result (its
        operator compiled now, as its run would compile it: shapes times dtypes).
        ``call``'s ticket holds the body and the store's copy of it while it is written
        (503 past the in-flight budget)."""
        store = self._available()
        head = call.head
        owner = self.owner(head.token)
        if req.prep is not None:
            raise InvalidArgumentError(
                "a job may run in any server process, and a prep handle is one process's: "
                "send the request without 'prep' (the job compiles what it needs)",
                field="prep",
            )
        entry = await asyncio.to_thread(self.service.registry.lookup, req.function)  # 404 now
        call.ticket.hold_body(2 * memoryview(body).nbytes)  # 503 before anything is compiled
        pinned = await asyncio.to_thread(self._pin, entry)
        expected = await self._expected_bytes(call, req)
        settings = self.settings
        rec = JobRecord(
            id=secrets.token_urlsafe(16), owner=owner, operator=call.op.name,
            function=req.function, status="queued", created=time.time(),
            has_aux=bool(getattr(req, "has_aux", False)),
            content_type=head.content_type, header_length=head.header_length,
            encoding=call.encoding,
            b64=response_encoding(head.content_type, None, body) == "b64",
            reserved_bytes=expected, digest=pinned[0] if pinned else None,
        )
        await asyncio.to_thread(
            store.create, rec, body, max_active=settings.max_jobs_per_token,
            max_bytes=settings.job_store_bytes or None, pin=pinned[1] if pinned else None,
        )
        log.info("job %s: %s of %s queued", rec.id, rec.operator, rec.function,
                 extra={"event": "job", "job": rec.id, "status": "queued",
                        "operator": rec.operator, "function": rec.function})
        self.start()
        if self._wake is not None:
            self._wake.set()
        return self.describe(rec)

    async def _expected_bytes(self, call: OperatorCall, req: OperatorRequest) -> int:
        """The bytes the job's result is expected to take (and its checkpoints, pieces of
        it), from its operator's prep. A prep past a per-call limit (result size, XLA's
        estimates, request shape) is that limit's 422 now, before anything is stored;
        0 for a request whose prep fails otherwise on its inputs (the job fails when it
        runs, with the plain call's error, and stores nothing)."""
        try:
            nbytes = await self.service.result_bytes(
                call.op.name, req.function, req.backend, req.x, req.tangents, req.contexts,
                batch_axis=req.batch_axis, has_aux=req.has_aux,
            )
        except (OverloadedError, DeadlineExceededError):
            raise  # busy now: retry the submission
        except (ResultTooLargeError, BudgetExceededError, RequestShapeError):
            raise  # a limit, decided at submission as the plain call decides it
        except DxError:
            return 0
        except Exception:  # noqa: BLE001 - the run will meet it too, and store it as its error
            log.exception("job of %s: its result could not be estimated", req.function)
            return 0
        return nbytes + _RESULT_FRAMING

    def _pin(self, entry: Any) -> tuple[str, bytes] | None:
        """``(digest, record)`` of the stored function ``entry`` names, as the job keeps
        it (``_unpin``); None for a function that is not stored (a module's)."""
        if entry.digest is None or self.service.registry.store is None:
            return None
        stored = self.service.registry.store.get(entry.name)
        if stored is None:
            return None
        head = json.dumps({"name": stored.name, "kind": stored.kind, "digest": stored.digest,
                           "metadata": stored.metadata, "created": stored.created})
        return stored.digest, head.encode() + b"\n" + stored.content

    async def _version(self, rec: JobRecord) -> Any:
        """The registry entry of the function version ``rec`` was submitted with, or
        None when that is the current one (the registry serves it)."""
        registry = self.service.registry
        try:
            current = await asyncio.to_thread(registry.lookup, rec.function)
        except UnknownFunctionError:
            current = None
        if current is not None and current.digest == rec.digest:
            return None
        data = await asyncio.to_thread(self._available().pinned, rec.id)
        if data is None:
            raise UnknownFunctionError(
                f"the version of {rec.function!r} this job was submitted with "
                f"({rec.digest}) is no longer stored: submit the job again", field="function",
            )
        return await asyncio.to_thread(_unpin, registry, data)

    def _past_limits(self, rec: JobRecord, size: int) -> DxError | None:
        """Why a result of ``size`` bytes cannot be stored for ``rec`` (None: it can): past
        the store's largest value, or past its reservation with no room left for it."""
        store = self._available()
        if store.max_blob_bytes is not None and size > store.max_blob_bytes:
            return result_too_big(size, store.max_blob_bytes)
        limit = self.settings.job_store_bytes
        if limit and size > rec.reserved_bytes:
            now = store.get(rec.id)
            others = store.stored_bytes() - (counted(now) if now is not None else 0)
            if others + size > limit:
                return jobs_full(others, limit, size, size)
        return None

    async def status(self, job_id: Any, token: str | None) -> dict[str, Any]:
        """The caller's job: status, progress, timings, and its error if it failed."""
        return self.describe(await self._mine(job_id, token))

    async def result(
        self, job_id: Any, token: str | None, accept: str | None, ticket: Ticket | None = None
    ) -> Answer:
        """The job's answer, negotiated as its operator's would be (``accept``). 409
        (``Retry-After``) until it ends; a failed job's own error; 409 if cancelled.
        ``ticket``: holds the answer's bytes in the in-flight budget (503 past it) until
        the caller, having sent it, releases the ticket."""
        rec = await self._mine(job_id, token)
        if not rec.ended:
            raise JobNotFinishedError(
                f"job {rec.id} is {rec.status}"
                + (f" ({rec.done} of {rec.total} {rec.unit})" if rec.total else "")
                + ": ask again later, or follow GET /jobs/{id}/events",
                field="id", retry_after=max(1, math.ceil(self.settings.job_poll_interval)),
                job_status=rec.status,
            )
        if rec.status == "cancelled":
            raise JobCancelledError(f"job {rec.id} was cancelled: it has no result", field="id")
        if rec.status == "failed":
            raise stored_error(rec.error or error_fields(InternalError("the job failed")))
        probe = _B64_PROBE if rec.b64 else b""
        encoding = response_encoding(rec.content_type, accept, probe) if accept else rec.encoding
        if ticket is not None:  # the stored bytes, and the encoded answer
            factor = costs_of(ENCODINGS[encoding]).encode_factor
            ticket.hold_body(int(rec.result_bytes * (1 + factor)))
        data = await asyncio.to_thread(self._available().result, rec.id)
        if data is None:
            raise UnknownJobError(f"job {rec.id}'s result is gone (removed)", field="id")
        return await self.answer(rec, data, encoding)

    async def answer(self, rec: JobRecord, data: bytes, encoding: str) -> Answer:
        """The stored binary result ``data`` of ``rec`` in ``encoding``."""
        if encoding == "binary":
            return Answer(codec.BINARY_TYPE, [data], len(data),
                          {codec.HEADER_LENGTH: rec.result_header or "0"})

        def encode() -> tuple[bytes, str, dict]:
            payload = codec.decode_body(data, codec.BINARY_TYPE, rec.result_header)
            return codec.encode_body(_sequences(payload), encoding)

        body, media, headers = (
            encode() if len(data) <= 1 << 16 else await asyncio.to_thread(encode)
        )
        return Answer(media, [body], len(body), headers)

    async def follow(self, job_id: Any, token: str | None) -> AsyncIterator[tuple[str, Any]]:
        """``events`` of the caller's job, its stream counted now: 404 and 429
        (``TooManyStreamsError``) are raised here, before anything is sent."""
        rec = await self._mine(job_id, token)
        owner = self.owner(token)
        watch = self._streams().open(rec, owner)
        return self.events(rec, watch, owner)

    def _streams(self) -> JobWatches:
        if self._job_watches is None:
            store = self._available()
            self._job_watches = JobWatches(
                store.get, self.settings.job_poll_interval,
                self.settings.max_streams_per_job, self.settings.max_streams_per_owner,
            )
        return self._job_watches

    async def events(
        self, rec: JobRecord, watch: Watch, owner: str
    ) -> AsyncIterator[tuple[str, Any]]:
        """The job's events until it ends: ``("progress", {"done", "total", "unit"})`` as
        it moves, ``("quiet", None)`` when a poll found nothing new, then ``("ended",
        record)``. Leaving early changes nothing of the job. Every stream of a job
        shares one ``Watch``: one store read per interval, whatever their number."""
        seen_version = watch.version
        try:
            last = (-1, None)  # (done, total) last told: progress only ever moves forward
            local, seen = None, 0  # this process's run of the job, and its reports told
            while True:
                run = self._jobs.get(rec.id)
                if run is not None and run.total is not None:  # every chunk, as it ends
                    if run is not local:
                        local, seen = run, 0
                    reports = run.reports[seen:]
                    seen += len(reports)
                    steps = [(done, run.total, run.unit) for done in reports]
                else:  # another process's run: what the store says now
                    steps = [(rec.done, rec.total, rec.unit)] if rec.total is not None else []
                for done, total, unit in steps:
                    if total != last[1] or done > last[0]:
                        last = (done, total)
                        yield "progress", {"done": done, "total": total, "unit": unit}
                if rec.ended:
                    if rec.total is not None and (rec.total, rec.done) != (last[1], last[0]) \
                            and rec.done > last[0]:
                        yield "progress", {"done": rec.done, "total": rec.total, "unit": rec.unit}
                    yield "ended", rec
                    return
                if not await watch.wait(seen_version, self.settings.job_poll_interval):
                    yield "quiet", None
                    continue
                seen_version = watch.version
                fresh = watch.rec
                if fresh is None:  # removed meanwhile
                    raise UnknownJobError(f"job {rec.id} was removed", field="id")
                rec = fresh
        finally:
            self._streams().close(watch, owner)

    async def cancel(self, job_id: Any, token: str | None) -> tuple[bool, dict[str, Any] | None]:
        """Cancel the caller's job, or remove it once it has ended: ``(removed, status
        document or None)``."""
        rec = await self._mine(job_id, token)
        store = self._available()
        if rec.ended:
            removed = await asyncio.to_thread(store.delete, rec.id, rec.owner)
            if removed:
                return True, None
            rec = await self._mine(job_id, token)
        rec = await asyncio.to_thread(store.request_cancel, rec.id, rec.owner, time.time())
        if rec is None:
            raise UnknownJobError(f"job {job_id!r} was removed", field="id")
        local = self._jobs.get(rec.id)
        if local is not None:
            local.cancel()  # at its next chunk, rather than its next heartbeat
        self._notify(rec.id)
        return False, self.describe(rec)

    async def list(
        self, token: str | None, limit: Any = 20, after: str | None = None
    ) -> dict[str, Any]:
        """The caller's jobs, newest first: ``{"jobs": [...], "next": cursor or None}``;
        pass ``next`` as ``after`` for the next page."""
        owner = self.owner(token)
        store = self._available()
        if isinstance(limit, str):
            limit = int(limit) if limit.strip().isdigit() else None
        if not isinstance(limit, int) or isinstance(limit, bool) or not 1 <= limit <= MAX_PAGE:
            raise InvalidArgumentError(
                f"limit must be a whole number from 1 to {MAX_PAGE}", field="limit"
            )
        cursor = _cursor_from(after) if after else None
        found = await asyncio.to_thread(store.list, owner, limit + 1, cursor)
        now = time.time()
        found = [r for r in found if not self._expired(r, now)]
        page = found[:limit]
        more = len(found) > limit and page
        return {
            "jobs": [self.describe(r) for r in page],
            "next": _cursor_of(page[-1]) if more else None,
        }

    def describe(self, rec: JobRecord) -> dict[str, Any]:
        """A job's status document (``error``: its problem's fields, without a status)."""
        now = time.time()
        queued = (rec.started or (rec.finished if rec.ended else None) or now) - rec.created
        running = None if rec.started is None else (rec.finished or now) - rec.started
        doc: dict[str, Any] = {
            "id": rec.id,
            "status": rec.status,
            "operator": rec.operator,
            "function": rec.function,
            "has_aux": rec.has_aux,
            "progress": {"done": rec.done, "total": rec.total, "unit": rec.unit},
            "created": _iso(rec.created),
            "started": _iso(rec.started),
            "finished": _iso(rec.finished),
            "timings": {
                "queued_seconds": round(max(queued, 0.0), 6),
                "running_seconds": None if running is None else round(max(running, 0.0), 6),
            },
            "attempts": rec.attempts,
            "chunks": {"computed": rec.computed, "restored": rec.restored},
            "cancel_requested": rec.cancel_requested,
            "result_bytes": rec.result_bytes,
            "expires": _iso(rec.finished + self.settings.job_result_ttl)
            if rec.ended and rec.finished is not None else None,
            "runner": rec.runner if rec.status == "running" else None,
            "error": dict(rec.error) if rec.error is not None else None,
        }
        return doc

    def stream_counts(self) -> tuple[int, int, int]:
        """``(streams open, jobs they follow, store reads made for them)`` here."""
        watches = self._job_watches
        if watches is None:
            return 0, 0, 0
        return watches.streams(), watches.watched(), watches.reads

    def counts(self) -> dict[str, int]:
        """Jobs in the store by status (every status named, 0 when none)."""
        found = self.store.counts() if self.store is not None else {}
        return {s: found.get(s, 0) for s in ("queued", "running", "succeeded", "failed",
                                             "cancelled")}

    # --- the runner -------------------------------------------------------------------
    def start(self) -> None:
        """Start claiming and running jobs on the running event loop (once)."""
        if self.store is None or self._loop_task is not None:
            return
        if self.open_call is None:
            raise RuntimeError("this Detached cannot run jobs: it was given no open_call")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._loop_task = self._loop.create_task(self._claiming(), name="dxserve-jobs")

    async def stop(self) -> None:
        """Stop running: jobs in flight go back to the queue (their checkpoints kept),
        for the next process to resume."""
        task, self._loop_task = self._loop_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for job in list(self._jobs.values()):
            job.released = True
            job.cancel()
        running = list(self._tasks.values())
        if running:
            await asyncio.wait(running, timeout=10)
        if self._job_watches is not None:
            self._job_watches.stop()

    async def _claiming(self) -> None:
        settings, store = self.settings, self.store
        assert store is not None and self._wake is not None
        next_expiry = 0.0
        while True:
            try:
                now = time.time()
                if now >= next_expiry:
                    removed = await asyncio.to_thread(store.expire, now - settings.job_result_ttl)
                    if removed:
                        log.info("jobs: %d expired job(s) removed", removed)
                    next_expiry = now + min(60.0, settings.job_result_ttl / 4)
                while len(self._tasks) < settings.job_runners and time.time() >= self._busy_until:
                    if not await asyncio.to_thread(store.has_work, time.time(), self.runner):
                        break
                    rec = await asyncio.to_thread(
                        store.claim, self.runner, settings.job_lease_seconds, time.time()
                    )
                    if rec is None:
                        break
                    if rec.status != "running":  # cancelled while nobody ran it
                        self._notify(rec.id)
                        continue
                    self.runs += 1
                    task = asyncio.get_running_loop().create_task(self._run(rec))
                    self._tasks[rec.id] = task
                    task.add_done_callback(lambda _, job_id=rec.id: self._ran(job_id))
            except DxError as exc:  # the store is unreachable or busy: try again later
                log.warning("jobs: cannot claim now: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), settings.job_poll_interval)
            self._wake.clear()

    def _ran(self, job_id: str) -> None:
        self._tasks.pop(job_id, None)
        self._jobs.pop(job_id, None)
        if self._wake is not None:
            self._wake.set()  # a runner is free
        self._notify(job_id)

    def _notify(self, job_id: str) -> None:
        if self._job_watches is not None:
            self._job_watches.notify(job_id)

    async def _run(self, rec: JobRecord) -> None:
        store = self.store
        assert store is not None
        kept = await asyncio.to_thread(store.chunks, rec.id)
        job = _StoredJob(self, rec, kept)
        self._jobs[rec.id] = job
        loop = asyncio.get_running_loop()
        job.listen(loop, lambda: self._notify(rec.id))
        log.info("job %s: %s of %s running (attempt %d, %d chunk(s) kept)", rec.id,
                 rec.operator, rec.function, rec.attempts, len(kept),
                 extra={"event": "job", "job": rec.id, "status": "running",
                        "attempt": rec.attempts})
        heartbeat = loop.create_task(self._heartbeat(job))
        try:
            await self._execute(rec, job)
        except Exception:  # noqa: BLE001 - a job's failure never stops the runner
            log.exception("job %s: the runner failed", rec.id)
        finally:
            heartbeat.cancel()
            self.restored += job.taken

    async def _heartbeat(self, job: _StoredJob) -> None:
        settings, store = self.settings, self.store
        assert store is not None
        while True:
            await asyncio.sleep(settings.job_lease_seconds / 3)
            try:
                rec = await asyncio.to_thread(
                    store.renew, job.id, self.runner, settings.job_lease_seconds, time.time()
                )
            except DxError as exc:
                log.warning("job %s: lease not renewed: %s", job.id, exc)
                continue
            if rec is None:
                log.warning("job %s: its lease was taken over; stopping here", job.id)
                job.lost = True
                job.cancel()
                return
            if rec.cancel_requested:
                job.cancel()

    async def _execute(self, rec: JobRecord, job: _StoredJob) -> None:
        """Run the job as ``POST /{operator}`` would, and store how it ended."""
        store = self.store
        assert store is not None
        body = await asyncio.to_thread(store.body, rec.id)
        if body is None:
            await self._finish(rec, job, "failed", error=InternalError(
                "the job's request body is missing from the store"))
            return
        assert self.open_call is not None  # ``start`` checked it
        try:
            entry = await self._version(rec) if rec.digest is not None else None
            call = self.open_call(rec.operator, rec.content_type, rec.header_length, len(body))
            with call.ticket:
                req = await call.decode(body)
                try:
                    results = await call.run(req, job, timeout=self.settings.job_timeout,
                                             entry=entry)
                finally:  # the last chunk's write, before the job's end is written
                    await asyncio.to_thread(job.drain)
                if results is not None and not job.cancelled:
                    answer = await call.encode(results, "binary")
                    data = b"".join(bytes(part) for part in answer.parts)
                    await self._finish(rec, job, "succeeded", result=data,
                                       header=answer.headers.get(codec.HEADER_LENGTH))
                    return
        except OverloadedError as exc:  # the server is busy: the job waits for room
            log.info("job %s: server busy (%s); back in the queue", rec.id, exc)
            self._busy_until = time.time() + _BUSY_BACKOFF
            await asyncio.to_thread(store.release, rec.id, self.runner)
            return
        except JobCancelled:
            pass
        except DxError as exc:
            await self._finish(rec, job, "failed", error=exc)
            return
        except Exception as exc:  # noqa: BLE001 - stored as the job's 500, logged
            log.exception("job %s failed", rec.id)
            await self._finish(rec, job, "failed", error=InternalError(
                f"{type(exc).__name__}; the server logged it"))
            return
        if job.lost:  # another runner holds it now
            return
        if job.released:
            await asyncio.to_thread(store.release, rec.id, self.runner)
            return
        await self._finish(rec, job, "cancelled")

    async def _finish(
        self, rec: JobRecord, job: _StoredJob, status: str, *, result: bytes | None = None,
        header: str | None = None, error: DxError | None = None,
    ) -> None:
        store = self.store
        assert store is not None
        if result is not None:
            past = await asyncio.to_thread(self._past_limits, rec, len(result))
            if past is not None:
                log.warning("job %s: its result of %d bytes is not stored: %s", rec.id,
                            len(result), past)
                status, result, header, error = "failed", None, None, past
        fields = error_fields(error) if error is not None else None
        try:
            done = await asyncio.to_thread(
                store.finish, rec.id, self.runner, status, time.time(), result=result,
                result_header=header, error=fields,
            )
        except StorageFullError as exc:  # the disk is full: the job ends failed, not stuck
            if result is None:
                raise
            log.warning("job %s: its result is not stored: %s", rec.id, exc)
            status = "failed"
            done = await asyncio.to_thread(
                store.finish, rec.id, self.runner, status, time.time(), error=error_fields(exc)
            )
        if done is None:
            log.warning("job %s: ended here as %s, but another runner holds it now",
                        rec.id, status)
            return
        log.info("job %s: %s", rec.id, status,
                 extra={"event": "job", "job": rec.id, "status": status})


def _unpin(registry: Any, data: bytes) -> Any:
    """The registry entry built from a job's pinned function (``Detached._pin``)."""
    head, _, content = data.partition(b"\n")
    doc = json.loads(head)
    if content_digest(content) != doc["digest"]:
        raise InternalError(f"the stored copy of {doc['name']!r} fails its hash check")
    record = StoredFunction(doc["name"], doc["kind"], doc["digest"], content, doc["metadata"],
                            doc["created"])
    with get_framework().precision_scope():  # as at registration: float64 signatures
        return registry.version(record)


def _cursor_of(rec: JobRecord) -> str:
    raw = json.dumps([rec.created, rec.id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _cursor_from(text: str) -> tuple[float, str]:
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
        created, job_id = json.loads(raw)
        # a page's last job as it was made: a finite time and an id of the store's form
        # (an overflowing number or a lone surrogate would reach the store otherwise)
        if (
            not isinstance(created, int | float) or isinstance(created, bool)
            or not isinstance(job_id, str) or not ID_PATTERN.fullmatch(job_id)
        ):
            raise ValueError(text)
        stamp = float(created)
        if not math.isfinite(stamp):
            raise ValueError(text)
        return stamp, job_id
    except (ValueError, TypeError, OverflowError, binascii.Error, UnicodeDecodeError) as exc:
        raise InvalidArgumentError(
            "after must be the 'next' of the previous GET /jobs page", field="after"
        ) from exc


def _sequences(tree: Any) -> Any:
    """A decoded result with its tuple and list nodes (``{"__tuple__": [...]}``) made
    ``SeqNode``s again, so that it encodes as it was stored."""
    if isinstance(tree, dict):
        if len(tree) == 1:
            marker = next(iter(tree))
            if marker in (TUPLE_MARKER, LIST_MARKER) and isinstance(tree[marker], list):
                return SeqNode(marker, [_sequences(v) for v in tree[marker]])
        return {k: _sequences(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_sequences(v) for v in tree]
    return tree
