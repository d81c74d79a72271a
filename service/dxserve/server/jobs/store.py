"""Detached jobs in the store: records, request bodies, checkpoints and results.

``open_jobs(store)`` gives the job store beside a function store (``open_store``): the
same SQLite or PostgreSQL database (tables ``jobs`` and ``job_chunks``), or, for a
directory store, ``<root>/jobs/<id>/``. Each job keeps:

* its record (``JobRecord``): owner, operator, status, progress, timings, lease;
* its request body as received (any encoding), so whichever process claims the job
  decodes and runs it as ``POST /{operator}`` would;
* its checkpoints: the finished chunks of a chunked run, by key (``jobs.Checkpoints``);
* its result: the answer in the binary encoding (the result's own bits).

Runs are claimed under a lease. ``claim`` gives a queued job, or a running one whose
lease has expired (its process died), to one runner inside a serialized write (SQLite
``BEGIN IMMEDIATE``, PostgreSQL's advisory lock), so exactly one process runs a job at
a time. The runner renews its lease while the job runs (``renew``), and every write of
a running job (``checkpoint``, ``progress``, ``finish``, ``release``) is taken only from
the runner that holds it: one whose lease was taken over stops at its next chunk. A
directory store belongs to one process (its lock), so a job that a dead process left
running there is claimable at once.

Limits, decided in ``create``'s serialized write: jobs queued and running per owner
(``TooManyJobsError``, 429) and the bytes all jobs hold or have reserved
(``StorageFullError``, 507). A job reserves, at submission, its body, the function
version it runs (``pin``) and the bytes its result is expected to take
(``reserved_bytes``, estimated from its compiled operator): its checkpoints are pieces
of that result, so they fit in the same reservation. The reservation is what the job
counts until it ends; then it counts its result alone, until it is removed. A result
larger than the store's largest value (``max_blob_bytes``: SQLite's length limit,
PostgreSQL's 1 GiB ``bytea``) is refused at submission (507), never attempted.

``claim`` takes turns between owners (round robin): the owner with the fewest jobs
running, then the one whose turn came longest ago in this process, then the oldest
job; one owner's long queue does not hold another owner's job back.
Times are seconds since the epoch (``time.time()``) of the process that writes them:
processes sharing a store need clocks that agree to well within a lease.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dxcontract.errors import StorageFullError, TooManyJobsError
from dxserve.server.stores.directory import DirectoryStore, _atomic_write, _is_tmp
from dxserve.server.stores.sql import SqlStore

log = logging.getLogger("dxserve.store")

__all__ = ["ACTIVE", "ENDED", "DirectoryJobs", "JobRecord", "JobStore", "SqlJobs", "open_jobs"]

#: A job waiting for a runner, or running.
ACTIVE = ("queued", "running")
#: A job that will not run again: its result, error or cancellation is final.
ENDED = ("succeeded", "failed", "cancelled")
#: A job id: URL-safe, never a path (``secrets.token_urlsafe``).
ID_PATTERN = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
_KEY_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,200}$")


@dataclass
class JobRecord:
    """One job as stored (see the module). Times are epoch seconds."""

    id: str
    owner: str  # a digest of the submitting token ("" for none)
    operator: str
    function: str
    status: str
    created: float
    has_aux: bool = False  # the function returns (output, aux); aux is one more result
    content_type: str | None = None  # the request body's, as sent
    header_length: str | None = None  # the binary framing's header length, as sent
    encoding: str = "json"  # the answer's encoding when the result's Accept names none
    b64: bool = False  # the JSON request carried base64 arrays (negotiation mirrors it)
    started: float | None = None
    finished: float | None = None
    done: int = 0
    total: int | None = None
    unit: str | None = None
    error: dict | None = None  # the problem's fields (no status: the HTTP layer's)
    runner: str | None = None
    lease_until: float = 0.0
    attempts: int = 0  # runs started, a resumed run counted again
    cancel_requested: bool = False
    computed: int = 0  # chunks computed and kept, over every run
    restored: int = 0  # chunks taken back from checkpoints, over every resumed run
    body_bytes: int = 0
    result_bytes: int = 0
    result_header: str | None = None  # the stored binary result's header length
    stored_bytes: int = 0  # what the job counts against the limit (``counted``)
    reserved_bytes: int = 0  # its result, estimated at submission (checkpoints included)
    chunk_bytes: int = 0  # its checkpoints, as kept now
    digest: str | None = None  # the stored function's version it runs (None: a module's)
    pin_bytes: int = 0  # the stored copy of that version (``JobStore.pinned``)

    @property
    def ended(self) -> bool:
        return self.status in ENDED

    def copy(self) -> JobRecord:
        return dataclasses.replace(self)


_COLUMNS = ("id", "owner", "status", "created", "finished", "runner", "lease_until",
            "stored_bytes")
_META = tuple(f.name for f in dataclasses.fields(JobRecord) if f.name not in _COLUMNS)
_SELECT = ", ".join((*_COLUMNS, "meta"))


def counted(rec: JobRecord) -> int:
    """The bytes ``rec`` counts against the job store's limit: while it may still run,
    its body, its pinned function and the larger of its reservation and its checkpoints;
    once ended, its result."""
    if rec.ended:
        return rec.result_bytes
    return rec.body_bytes + rec.pin_bytes + max(rec.reserved_bytes, rec.chunk_bytes)


def _meta(rec: JobRecord) -> str:
    return json.dumps({name: getattr(rec, name) for name in _META}, sort_keys=True)


def _from_row(row: Any) -> JobRecord:
    values = dict(zip(_COLUMNS, row[:len(_COLUMNS)], strict=True))
    meta = json.loads(row[len(_COLUMNS)])
    values.update({k: v for k, v in meta.items() if k in _META})
    values["stored_bytes"] = int(values["stored_bytes"])
    return JobRecord(**values)


def too_many_jobs(limit: int) -> TooManyJobsError:
    """The 429 for a submission past the jobs one token may have queued and running."""
    return TooManyJobsError(
        f"you have {limit} jobs queued or running, the most a token may: wait for one to "
        "end or cancel one (DELETE /jobs/{id}); DXSERVE_MAX_JOBS_PER_TOKEN sets the limit",
        field="Authorization", limit="max_jobs_per_token", maximum=limit,
    )


def jobs_full(used: int, limit: int, needed: int, result: int = 0) -> StorageFullError:
    """The 507 for a submission past the bytes the jobs may hold or reserve."""
    of_result = f", {result:,} of them for its expected result" if result else ""
    return StorageFullError(
        f"the job store is full: jobs hold or have reserved {used:,} of {limit:,} bytes "
        f"(inputs, checkpoints and results), and this job needs {needed:,} more{of_result}; "
        "fetch and delete results (DELETE /jobs/{id}), wait for them to expire "
        "(DXSERVE_JOB_RESULT_TTL), or ask for a smaller result; DXSERVE_JOB_STORE_BYTES "
        "sets the limit",
        field="body", limit="job_store_bytes", maximum=limit, needed=needed,
    )


def result_too_big(result: int, limit: int) -> StorageFullError:
    """The 507 for a job whose result would be larger than the store can keep as one
    value."""
    return StorageFullError(
        f"this job's result would take {result:,} bytes, more than the largest value this "
        f"job store keeps ({limit:,} bytes); ask for a smaller result (fewer columns, rows "
        "or points per job: pushforward or pullback on a part of the tangents), or serve "
        "with a directory store (DXSERVE_STORE=dir://...)",
        field="x", limit="store_blob_bytes", maximum=limit, needed=result,
    )


class JobStore:
    """What the job service needs of a store (both backends implement every method;
    each may be called from any thread). ``runner`` arguments name the process that
    claimed the job; a method of a running job returns None when that runner no longer
    holds it."""

    #: the largest result (or body) one value of the store holds (None: no limit)
    max_blob_bytes: int | None = None

    def create(self, rec: JobRecord, body: Any, *, max_active: int | None,
               max_bytes: int | None, pin: bytes | None = None) -> None:
        """Store a queued job: its record, ``body`` (bytes-like) and ``pin`` (the stored
        function version it runs, ``pinned``); 429 past ``max_active`` jobs of its
        owner, 507 past ``max_bytes`` held and reserved (see ``counted``)."""
        raise NotImplementedError

    def pinned(self, job_id: str) -> bytes | None:
        """The function version a job was submitted with, as ``create`` got it."""
        raise NotImplementedError

    def get(self, job_id: str) -> JobRecord | None:
        raise NotImplementedError

    def body(self, job_id: str) -> bytes | None:
        raise NotImplementedError

    def result(self, job_id: str) -> bytes | None:
        raise NotImplementedError

    def list(self, owner: str, limit: int, after: tuple[float, str] | None) -> list[JobRecord]:
        """The owner's jobs, newest first, after ``(created, id)`` of the last one seen."""
        raise NotImplementedError

    def has_work(self, now: float, runner: str) -> bool:
        """Is any job claimable now (a cheap read before ``claim``'s write)?"""
        raise NotImplementedError

    def claim(self, runner: str, lease: float, now: float) -> JobRecord | None:
        raise NotImplementedError

    def renew(self, job_id: str, runner: str, lease: float, now: float) -> JobRecord | None:
        raise NotImplementedError

    def checkpoint(self, job_id: str, runner: str, key: str, data: bytes, done: int,
                   total: int, unit: str) -> JobRecord | None:
        raise NotImplementedError

    def progress(self, job_id: str, runner: str, done: int, total: int | None,
                 unit: str | None, restored: int = 0) -> JobRecord | None:
        raise NotImplementedError

    def chunks(self, job_id: str) -> dict[str, bytes]:
        raise NotImplementedError

    def finish(self, job_id: str, runner: str, status: str, now: float, *,
               result: bytes | None = None, result_header: str | None = None,
               error: dict | None = None) -> JobRecord | None:
        raise NotImplementedError

    def release(self, job_id: str, runner: str) -> JobRecord | None:
        """Put a running job back in the queue (its runner is stopping); checkpoints stay."""
        raise NotImplementedError

    def request_cancel(self, job_id: str, owner: str, now: float) -> JobRecord | None:
        """A queued job cancelled, a running one asked to stop; None: no such job."""
        raise NotImplementedError

    def delete(self, job_id: str, owner: str) -> bool:
        """Remove an ended job of ``owner`` with everything it holds."""
        raise NotImplementedError

    def expire(self, before: float) -> int:
        """Remove the jobs that ended before ``before``; how many."""
        raise NotImplementedError

    def counts(self) -> dict[str, int]:
        """Jobs by status."""
        raise NotImplementedError

    def stored_bytes(self) -> int:
        raise NotImplementedError


class _Turns:
    """Whose turn it is to have a job claimed (this process's round robin)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}
        self._count = 0
        self._lock = threading.Lock()

    def pick(self, waiting: dict[str, tuple[float, str]], running: dict[str, int]) -> str | None:
        """Of the owners with a claimable job (``waiting``: owner -> its oldest job's
        ``(created, id)``), the one to serve next: fewest jobs running, then the one
        served longest ago (never served first), then the oldest job."""
        if not waiting:
            return None
        with self._lock:
            return min(waiting, key=lambda o: (running.get(o, 0), self._last.get(o, -1),
                                               waiting[o]))

    def served(self, owner: str) -> None:
        with self._lock:
            self._count += 1
            self._last[owner] = self._count
            if len(self._last) > 100_000:  # owners long gone: forget the older half
                keep = sorted(self._last.items(), key=lambda kv: kv[1])[50_000:]
                self._last = dict(keep)


def _claimed(rec: JobRecord, runner: str, lease: float, now: float) -> JobRecord:
    """``rec`` as ``claim`` leaves it: running under ``runner``, or cancelled when its
    owner asked while nobody ran it."""
    rec.attempts += 1
    if rec.cancel_requested:
        _end(rec, "cancelled", now)
        return rec
    rec.status, rec.runner, rec.lease_until = "running", runner, now + lease
    rec.started = rec.started or now
    return rec


def _end(rec: JobRecord, status: str, now: float) -> None:
    rec.status, rec.finished, rec.runner, rec.lease_until = status, now, None, 0.0


def _advance(rec: JobRecord, done: int, total: int | None, unit: str | None) -> None:
    rec.done = max(done, 0)
    if total is not None:
        rec.total, rec.unit = total, unit


# --- SQL (SQLite, PostgreSQL) ----------------------------------------------------------
_SQL_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, owner TEXT NOT NULL, "
    "status TEXT NOT NULL, created {real} NOT NULL, finished {real}, runner TEXT, "
    "lease_until {real} NOT NULL, stored_bytes {int} NOT NULL, meta TEXT NOT NULL, "
    "body {blob}, result {blob})",
    "CREATE INDEX IF NOT EXISTS jobs_owner ON jobs (owner, created)",
    "CREATE INDEX IF NOT EXISTS jobs_status ON jobs (status, lease_until)",
    "CREATE TABLE IF NOT EXISTS job_chunks (job TEXT NOT NULL, key TEXT NOT NULL, "
    "data {blob} NOT NULL, PRIMARY KEY (job, key))",
)
_TYPES = {
    "sqlite": {"real": "REAL", "int": "INTEGER", "blob": "BLOB"},
    "postgres": {"real": "DOUBLE PRECISION", "int": "BIGINT", "blob": "BYTEA"},
}
_CLAIMABLE = "(status = 'queued' OR (status = 'running' AND lease_until < ?))"
#: the key in ``job_chunks`` of a job's pinned function (never a checkpoint's: those
#: are ``{plan}.{start}``)
_PIN = "function"
#: room left in a row beside its largest value (the record's other columns)
_ROW_MARGIN = 1 << 20
#: PostgreSQL's largest ``bytea`` value
_BYTEA_BYTES = 1 << 30


class SqlJobs(JobStore):
    """Jobs in the database of a ``SqlStore`` (SQLite or PostgreSQL): its connection,
    its serialized write transactions and its error handling (503 when unreachable)."""

    def __init__(self, store: SqlStore) -> None:
        self.store = store
        dialect = "postgres" if store._p == "%s" else "sqlite"
        with store._writing() as cur:  # schema creation serialized like any write
            for statement in _SQL_SCHEMA:
                cur.execute(statement.format(**_TYPES[dialect]))
        self.max_blob_bytes = _blob_limit(store, dialect) - _ROW_MARGIN
        self._turns = _Turns()

    def _write(self) -> contextlib.AbstractContextManager[Any]:
        return self.store._writing()

    def _q(self, statement: str) -> str:
        return self.store._sql(statement)

    def _read(self, statement: str, params: tuple = (), *, many: bool = False) -> Any:
        return self.store._query(statement, params, many=many)

    def _row(self, cur: Any, job_id: str) -> JobRecord | None:
        cur.execute(self._q(f"SELECT {_SELECT} FROM jobs WHERE id = ?"), (job_id,))
        row = cur.fetchone()
        return _from_row(row) if row is not None else None

    def _save(self, cur: Any, rec: JobRecord, **blobs: Any) -> None:
        sets = ", ".join(f"{c} = ?" for c in (*_COLUMNS[1:], "meta", *blobs))
        values = (*(getattr(rec, c) for c in _COLUMNS[1:]), _meta(rec), *blobs.values())
        cur.execute(self._q(f"UPDATE jobs SET {sets} WHERE id = ?"), (*values, rec.id))

    def _owned(self, cur: Any, job_id: str, runner: str) -> JobRecord | None:
        rec = self._row(cur, job_id)
        if rec is None or rec.status != "running" or rec.runner != runner:
            return None
        return rec

    # -- JobStore ----------------------------------------------------------------------
    def create(self, rec: JobRecord, body: Any, *, max_active: int | None,
               max_bytes: int | None, pin: bytes | None = None) -> None:
        _admit_sizes(rec, body, pin, self.max_blob_bytes)
        with self._write() as cur:
            if max_active is not None:
                cur.execute(self._q("SELECT COUNT(*) FROM jobs WHERE owner = ? AND status IN "
                                    "('queued', 'running')"), (rec.owner,))
                if int(cur.fetchone()[0]) >= max_active:
                    raise too_many_jobs(max_active)
            if max_bytes:
                cur.execute("SELECT COALESCE(SUM(stored_bytes), 0) FROM jobs")
                used = int(cur.fetchone()[0])
                if used + rec.stored_bytes > max_bytes:
                    raise jobs_full(used, max_bytes, rec.stored_bytes, rec.reserved_bytes)
            cols = (*_COLUMNS, "meta", "body")
            values = (*(getattr(rec, c) for c in _COLUMNS), _meta(rec), body)
            cur.execute(
                self._q(f"INSERT INTO jobs ({', '.join(cols)}) VALUES "
                        f"({', '.join('?' * len(cols))})"), values,
            )
            if pin is not None:
                cur.execute(self._q("INSERT INTO job_chunks (job, key, data) VALUES (?, ?, ?)"),
                            (rec.id, _PIN, pin))

    def pinned(self, job_id: str) -> bytes | None:
        row = self._read("SELECT data FROM job_chunks WHERE job = ? AND key = ?", (job_id, _PIN))
        return bytes(row[0]) if row is not None else None

    def get(self, job_id: str) -> JobRecord | None:
        row = self._read(f"SELECT {_SELECT} FROM jobs WHERE id = ?", (job_id,))
        return _from_row(row) if row is not None else None

    def body(self, job_id: str) -> bytes | None:
        row = self._read("SELECT body FROM jobs WHERE id = ?", (job_id,))
        return bytes(row[0]) if row is not None and row[0] is not None else None

    def result(self, job_id: str) -> bytes | None:
        row = self._read("SELECT result FROM jobs WHERE id = ?", (job_id,))
        return bytes(row[0]) if row is not None and row[0] is not None else None

    def list(self, owner: str, limit: int, after: tuple[float, str] | None) -> list[JobRecord]:
        where, params = "owner = ?", [owner]
        if after is not None:
            where += " AND (created < ? OR (created = ? AND id < ?))"
            params += [after[0], after[0], after[1]]
        rows = self._read(
            f"SELECT {_SELECT} FROM jobs WHERE {where} ORDER BY created DESC, id DESC LIMIT ?",
            (*params, limit), many=True,
        )
        return [_from_row(row) for row in rows]

    def has_work(self, now: float, runner: str) -> bool:
        return self._read(f"SELECT 1 FROM jobs WHERE {_CLAIMABLE} LIMIT 1", (now,)) is not None

    def claim(self, runner: str, lease: float, now: float) -> JobRecord | None:
        with self._write() as cur:
            cur.execute(self._q(f"SELECT owner, MIN(created) FROM jobs WHERE {_CLAIMABLE} "
                                "GROUP BY owner"), (now,))
            waiting = {row[0]: (float(row[1]), "") for row in cur.fetchall()}
            if not waiting:
                return None
            cur.execute(self._q("SELECT owner, COUNT(*) FROM jobs WHERE status = 'running' "
                                "AND lease_until >= ? GROUP BY owner"), (now,))
            running = {row[0]: int(row[1]) for row in cur.fetchall()}
            owner = self._turns.pick(waiting, running)
            cur.execute(
                self._q(f"SELECT {_SELECT} FROM jobs WHERE {_CLAIMABLE} AND owner = ? "
                        "ORDER BY created, id LIMIT 1"), (now, owner),
            )
            row = cur.fetchone()
            if row is None:
                return None
            rec = _claimed(_from_row(row), runner, lease, now)
            self._save(cur, rec)
        self._turns.served(rec.owner)
        return rec

    def renew(self, job_id: str, runner: str, lease: float, now: float) -> JobRecord | None:
        with self._write() as cur:
            rec = self._owned(cur, job_id, runner)
            if rec is not None:
                rec.lease_until = now + lease
                self._save(cur, rec)
        return rec

    def checkpoint(self, job_id: str, runner: str, key: str, data: bytes, done: int,
                   total: int, unit: str) -> JobRecord | None:
        with self._write() as cur:
            rec = self._owned(cur, job_id, runner)
            if rec is None:
                return None
            cur.execute(self._q("SELECT LENGTH(data) FROM job_chunks WHERE job = ? AND key = ?"),
                        (job_id, key))
            old = cur.fetchone()
            if old is not None:
                cur.execute(self._q("DELETE FROM job_chunks WHERE job = ? AND key = ?"),
                            (job_id, key))
            cur.execute(self._q("INSERT INTO job_chunks (job, key, data) VALUES (?, ?, ?)"),
                        (job_id, key, data))
            rec.chunk_bytes += len(data) - (int(old[0]) if old is not None else 0)
            rec.stored_bytes = counted(rec)
            rec.computed += 1
            _advance(rec, done, total, unit)
            self._save(cur, rec)
        return rec

    def progress(self, job_id: str, runner: str, done: int, total: int | None,
                 unit: str | None, restored: int = 0) -> JobRecord | None:
        with self._write() as cur:
            rec = self._owned(cur, job_id, runner)
            if rec is not None:
                _advance(rec, done, total, unit)
                rec.restored += restored
                self._save(cur, rec)
        return rec

    def chunks(self, job_id: str) -> dict[str, bytes]:
        rows = self._read("SELECT key, data FROM job_chunks WHERE job = ? AND key <> ?",
                          (job_id, _PIN), many=True)
        return {row[0]: bytes(row[1]) for row in rows}

    def finish(self, job_id: str, runner: str, status: str, now: float, *,
               result: bytes | None = None, result_header: str | None = None,
               error: dict | None = None) -> JobRecord | None:
        with self._write() as cur:
            rec = self._owned(cur, job_id, runner)
            if rec is None:
                return None
            _end(rec, status, now)
            rec.error, rec.result_header = error, result_header
            rec.result_bytes = len(result) if result is not None else 0
            rec.chunk_bytes = 0
            rec.stored_bytes = counted(rec)
            cur.execute(self._q("DELETE FROM job_chunks WHERE job = ?"), (job_id,))
            self._save(cur, rec, body=None, result=result)
        return rec

    def release(self, job_id: str, runner: str) -> JobRecord | None:
        with self._write() as cur:
            rec = self._owned(cur, job_id, runner)
            if rec is not None:
                rec.status, rec.runner, rec.lease_until = "queued", None, 0.0
                self._save(cur, rec)
        return rec

    def request_cancel(self, job_id: str, owner: str, now: float) -> JobRecord | None:
        with self._write() as cur:
            rec = self._row(cur, job_id)
            if rec is None or rec.owner != owner:
                return None
            if rec.status == "queued":
                _end(rec, "cancelled", now)
                rec.chunk_bytes = rec.stored_bytes = 0
                cur.execute(self._q("DELETE FROM job_chunks WHERE job = ?"), (job_id,))
                self._save(cur, rec, body=None)
            elif rec.status == "running" and not rec.cancel_requested:
                rec.cancel_requested = True
                self._save(cur, rec)
        return rec

    def delete(self, job_id: str, owner: str) -> bool:
        with self._write() as cur:
            rec = self._row(cur, job_id)
            if rec is None or rec.owner != owner or not rec.ended:
                return False
            cur.execute(self._q("DELETE FROM job_chunks WHERE job = ?"), (job_id,))
            cur.execute(self._q("DELETE FROM jobs WHERE id = ?"), (job_id,))
        return True

    def expire(self, before: float) -> int:
        ended = "status IN ('succeeded', 'failed', 'cancelled') AND finished < ?"
        with self._write() as cur:
            cur.execute(self._q(f"SELECT COUNT(*) FROM jobs WHERE {ended}"), (before,))
            count = int(cur.fetchone()[0])
            if count:
                cur.execute(self._q(
                    f"DELETE FROM job_chunks WHERE job IN (SELECT id FROM jobs WHERE {ended})"
                ), (before,))
                cur.execute(self._q(f"DELETE FROM jobs WHERE {ended}"), (before,))
        return count

    def counts(self) -> dict[str, int]:
        rows = self._read("SELECT status, COUNT(*) FROM jobs GROUP BY status", many=True)
        return {row[0]: int(row[1]) for row in rows}

    def stored_bytes(self) -> int:
        return int(self._read("SELECT COALESCE(SUM(stored_bytes), 0) FROM jobs")[0])


def _blob_limit(store: SqlStore, dialect: str) -> int:
    """The largest value (and row) the database keeps: SQLite's length limit as this
    connection has it (10^9 bytes unless compiled otherwise), PostgreSQL's 1 GiB."""
    if dialect == "postgres":
        return _BYTEA_BYTES
    import sqlite3

    with store._mutex:
        return int(store._conn.getlimit(sqlite3.SQLITE_LIMIT_LENGTH))


def _admit_sizes(rec: JobRecord, body: Any, pin: bytes | None, max_blob: int | None) -> None:
    """Set what a new job counts (``counted``); 507 for a result (or body) larger than
    one value of the store holds."""
    rec.body_bytes = memoryview(body).nbytes
    rec.pin_bytes = len(pin) if pin is not None else 0
    rec.chunk_bytes = 0
    rec.stored_bytes = counted(rec)
    if max_blob is not None and max(rec.reserved_bytes, rec.body_bytes) > max_blob:
        raise result_too_big(max(rec.reserved_bytes, rec.body_bytes), max_blob)


# --- a directory store -----------------------------------------------------------------
class DirectoryJobs(JobStore):
    """Jobs under ``<root>/jobs/<id>/`` of a ``DirectoryStore``: ``record.json``,
    ``body``, ``result`` and ``chunks/<key>``, each written atomically (as the store
    writes its own files). One process owns the directory, so the records are kept in
    memory and a job left running by an earlier process is claimable at once; what an
    earlier process left half-written (a write's temporary file, a job directory whose
    record was never written) is removed when the directory is opened."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._records: dict[str, JobRecord] = {}
        #: runners that claimed through this object: the only ones alive (one process
        #: owns the directory), so a job any other runner holds was an earlier process's
        self._runners: set[str] = set()
        self._turns = _Turns()
        for path in sorted(self.root.iterdir()):
            _remove_partial(path)
            rec = self._load(path)
            if rec is not None:
                self._records[rec.id] = rec

    def _load(self, path: Path) -> JobRecord | None:
        if not (path.is_dir() and ID_PATTERN.fullmatch(path.name)):
            return None
        try:
            doc = json.loads((path / "record.json").read_bytes())
            rec = JobRecord(**{k: v for k, v in doc.items() if k in _COLUMNS + _META})
            if rec.id != path.name:
                raise ValueError("its id is not its directory's name")
            return rec
        except (OSError, ValueError, TypeError) as exc:
            log.warning("jobs: skipping unreadable job %s: %s", path.name, exc)
            return None

    def _dir(self, job_id: str) -> Path:
        if not ID_PATTERN.fullmatch(job_id):
            raise ValueError(f"bad job id {job_id!r}")
        return self.root / job_id

    def _write_record(self, rec: JobRecord) -> None:
        _atomic_write(self._dir(rec.id) / "record.json",
                      json.dumps(dataclasses.asdict(rec), sort_keys=True).encode())
        self._records[rec.id] = rec

    def _read_file(self, job_id: str, name: str) -> bytes | None:
        try:
            return (self._dir(job_id) / name).read_bytes()
        except (OSError, ValueError):
            return None

    @contextlib.contextmanager
    def _running(self, job_id: str, runner: str) -> Iterator[JobRecord | None]:
        with self._lock:
            rec = self._records.get(job_id)
            if rec is None or rec.status != "running" or rec.runner != runner:
                yield None
                return
            rec = rec.copy()
            yield rec
            self._write_record(rec)

    def _drop_inputs(self, job_id: str) -> None:
        """Remove what only a run needs: checkpoints, body and pinned function."""
        shutil.rmtree(self._dir(job_id) / "chunks", ignore_errors=True)
        for name in ("body", _PIN):
            with contextlib.suppress(FileNotFoundError):
                (self._dir(job_id) / name).unlink()

    # -- JobStore ----------------------------------------------------------------------
    def create(self, rec: JobRecord, body: Any, *, max_active: int | None,
               max_bytes: int | None, pin: bytes | None = None) -> None:
        _admit_sizes(rec, body, pin, self.max_blob_bytes)
        with self._lock:
            if max_active is not None and sum(
                1 for r in self._records.values() if r.owner == rec.owner and not r.ended
            ) >= max_active:
                raise too_many_jobs(max_active)
            used = self.stored_bytes()
            if max_bytes and used + rec.stored_bytes > max_bytes:
                raise jobs_full(used, max_bytes, rec.stored_bytes, rec.reserved_bytes)
            self._dir(rec.id).mkdir()
            _atomic_write(self._dir(rec.id) / "body", body)
            if pin is not None:
                _atomic_write(self._dir(rec.id) / _PIN, pin)
            self._write_record(rec.copy())

    def pinned(self, job_id: str) -> bytes | None:
        return self._read_file(job_id, _PIN)

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            rec = self._records.get(job_id)
            return rec.copy() if rec is not None else None

    def body(self, job_id: str) -> bytes | None:
        return self._read_file(job_id, "body")

    def result(self, job_id: str) -> bytes | None:
        return self._read_file(job_id, "result")

    def list(self, owner: str, limit: int, after: tuple[float, str] | None) -> list[JobRecord]:
        with self._lock:
            mine = [r for r in self._records.values() if r.owner == owner]
        mine.sort(key=lambda r: (r.created, r.id), reverse=True)
        if after is not None:
            mine = [r for r in mine if (r.created, r.id) < after]
        return [r.copy() for r in mine[:limit]]

    def _claimable(self, rec: JobRecord, runner: str, now: float) -> bool:
        return rec.status == "queued" or rec.status == "running" and (
            rec.lease_until < now or rec.runner not in self._runners
        )

    def has_work(self, now: float, runner: str) -> bool:
        with self._lock:
            return any(self._claimable(r, runner, now) for r in self._records.values())

    def claim(self, runner: str, lease: float, now: float) -> JobRecord | None:
        with self._lock:
            self._runners.add(runner)
            waiting: dict[str, tuple[float, str]] = {}
            running: dict[str, int] = {}
            for r in self._records.values():
                if self._claimable(r, runner, now):
                    waiting[r.owner] = min(waiting.get(r.owner, (r.created, r.id)),
                                           (r.created, r.id))
                elif r.status == "running":
                    running[r.owner] = running.get(r.owner, 0) + 1
            owner = self._turns.pick(waiting, running)
            if owner is None:
                return None
            first = self._records[waiting[owner][1]]
            rec = _claimed(first.copy(), runner, lease, now)
            self._write_record(rec)
            self._turns.served(owner)
            return rec.copy()

    def renew(self, job_id: str, runner: str, lease: float, now: float) -> JobRecord | None:
        with self._running(job_id, runner) as rec:
            if rec is not None:
                rec.lease_until = now + lease
        return rec

    def checkpoint(self, job_id: str, runner: str, key: str, data: bytes, done: int,
                   total: int, unit: str) -> JobRecord | None:
        if not _KEY_PATTERN.fullmatch(key):
            raise ValueError(f"bad checkpoint key {key!r}")
        with self._running(job_id, runner) as rec:
            if rec is not None:
                chunks = self._dir(job_id) / "chunks"
                chunks.mkdir(exist_ok=True)
                path = chunks / key
                old = path.stat().st_size if path.exists() else 0
                _atomic_write(path, data)
                rec.chunk_bytes += len(data) - old
                rec.stored_bytes = counted(rec)
                rec.computed += 1
                _advance(rec, done, total, unit)
        return rec

    def progress(self, job_id: str, runner: str, done: int, total: int | None,
                 unit: str | None, restored: int = 0) -> JobRecord | None:
        with self._running(job_id, runner) as rec:
            if rec is not None:
                _advance(rec, done, total, unit)
                rec.restored += restored
        return rec

    def chunks(self, job_id: str) -> dict[str, bytes]:
        chunks = self._dir(job_id) / "chunks"
        found: dict[str, bytes] = {}
        with contextlib.suppress(FileNotFoundError):
            for path in chunks.iterdir():
                if _KEY_PATTERN.fullmatch(path.name) and not path.name.startswith("."):
                    found[path.name] = path.read_bytes()
        return found

    def finish(self, job_id: str, runner: str, status: str, now: float, *,
               result: bytes | None = None, result_header: str | None = None,
               error: dict | None = None) -> JobRecord | None:
        with self._running(job_id, runner) as rec:
            if rec is not None:
                if result is not None:
                    _atomic_write(self._dir(job_id) / "result", result)
                _end(rec, status, now)
                rec.error, rec.result_header = error, result_header
                rec.result_bytes = len(result) if result is not None else 0
                rec.chunk_bytes = 0
                rec.stored_bytes = counted(rec)
                self._drop_inputs(job_id)
        return rec

    def release(self, job_id: str, runner: str) -> JobRecord | None:
        with self._running(job_id, runner) as rec:
            if rec is not None:
                rec.status, rec.runner, rec.lease_until = "queued", None, 0.0
        return rec

    def request_cancel(self, job_id: str, owner: str, now: float) -> JobRecord | None:
        with self._lock:
            rec = self._records.get(job_id)
            if rec is None or rec.owner != owner:
                return None
            rec = rec.copy()
            if rec.status == "queued":
                _end(rec, "cancelled", now)
                rec.chunk_bytes = rec.stored_bytes = 0
                self._drop_inputs(job_id)
                self._write_record(rec)
            elif rec.status == "running" and not rec.cancel_requested:
                rec.cancel_requested = True
                self._write_record(rec)
            return rec.copy()

    def _remove(self, job_id: str) -> None:
        self._records.pop(job_id, None)
        shutil.rmtree(self._dir(job_id), ignore_errors=True)

    def delete(self, job_id: str, owner: str) -> bool:
        with self._lock:
            rec = self._records.get(job_id)
            if rec is None or rec.owner != owner or not rec.ended:
                return False
            self._remove(job_id)
            return True

    def expire(self, before: float) -> int:
        with self._lock:
            old = [r.id for r in self._records.values()
                   if r.ended and r.finished is not None and r.finished < before]
            for job_id in old:
                self._remove(job_id)
            return len(old)

    def counts(self) -> dict[str, int]:
        with self._lock:
            found: dict[str, int] = {}
            for rec in self._records.values():
                found[rec.status] = found.get(rec.status, 0) + 1
            return found

    def stored_bytes(self) -> int:
        with self._lock:
            return sum(r.stored_bytes for r in self._records.values())


def _remove_partial(path: Path) -> None:
    """Remove what a process killed mid-write left under a job directory ``path``: the
    temporary files of its atomic writes (a partial result or checkpoint), or the whole
    directory when its record was never written (killed while it was created)."""
    if not path.is_dir() or not ID_PATTERN.fullmatch(path.name):
        return
    if not (path / "record.json").exists():
        log.info("jobs: removing %s, a job never completely created", path.name)
        shutil.rmtree(path, ignore_errors=True)
        return
    for folder in (path, path / "chunks"):
        with contextlib.suppress(FileNotFoundError):
            for item in folder.iterdir():
                if item.is_file() and _is_tmp(item):
                    log.info("jobs: removing %s, left half-written", item)
                    with contextlib.suppress(OSError):
                        item.unlink()


def open_jobs(store: Any) -> JobStore | None:
    """The job store beside ``store`` (a function store from ``open_store``), or None
    for a store that keeps no jobs."""
    if isinstance(store, SqlStore):
        return SqlJobs(store)
    if isinstance(store, DirectoryStore):
        return DirectoryJobs(store.root / "jobs")
    return None
