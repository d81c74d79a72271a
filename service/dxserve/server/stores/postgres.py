"""The store for processes on many machines: PostgreSQL through psycopg 3
(``DXSERVE_STORE=postgresql://user@host:port/db``; the ``postgres`` extra:
``pip install -e '.[postgres]'`` at the repository root).

Writes are serialized by a transaction-scoped advisory lock, so the 409/``replace``
rules and the quota hold across every process on every machine. Durability is the
server's: with PostgreSQL's default ``synchronous_commit=on`` a commit returns once its
WAL record is flushed, so an acknowledged registration survives SIGKILL of any dxserve
process (and of PostgreSQL itself).

Staying current: every write sends ``NOTIFY dxserve_store`` in its transaction; a
listener thread with its own connection turns each notification into a hint
(``maybe_changed``), so other processes re-read the changed names on their next
request, typically within milliseconds. Notifications are lost while a listener is
reconnecting, so the registry also asks ``changes`` at least every
``store_sync_interval`` seconds: that is the documented bound.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

from dxserve.server.stores.sql import SqlStore

log = logging.getLogger("dxserve.store")

_CHANNEL = "dxserve_store"
_LOCK_KEY = 0x64787376  # "dxsv": the advisory lock every writer takes

_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS functions (name TEXT PRIMARY KEY, kind TEXT NOT NULL, "
    "digest TEXT NOT NULL, size BIGINT NOT NULL, metadata TEXT NOT NULL, created TEXT NOT NULL)",
    "CREATE INDEX IF NOT EXISTS functions_digest ON functions (digest)",
    "CREATE TABLE IF NOT EXISTS objects (digest TEXT PRIMARY KEY, content BYTEA NOT NULL, "
    "size BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS changes (seq BIGSERIAL PRIMARY KEY, name TEXT NOT NULL)",
]


def _psycopg() -> Any:
    try:
        import psycopg
    except ImportError as exc:  # pragma: no cover - the extra is missing
        from dxcontract.extras import SERVER, install_hint

        raise RuntimeError(
            f"a postgresql:// store needs psycopg 3: {install_hint('postgres', SERVER)}"
        ) from exc
    return psycopg


class PostgresStore(SqlStore):
    """``FunctionStore`` in a PostgreSQL database shared by processes on any machine."""

    _p = "%s"
    #: Changes arrive as notifications: the registry checks the hint on every request.
    pushes_changes = True

    def __init__(self, url: str, *, quota_bytes: int | None = None, connect_timeout: int = 10):
        super().__init__(quota_bytes=quota_bytes)
        self._psycopg = _psycopg()
        self.url = url
        self.root = None
        self._connect_timeout = connect_timeout
        self._conn = self._connect()
        with self._write() as cur:  # schema creation serialized like any write
            for statement in _SCHEMA:
                cur.execute(statement)
        self._hint = threading.Event()
        self._hint.set()  # the first check always reads
        self._closed = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="dxserve-store-listen",
                                          daemon=True)
        self._listener.start()
        log.info("store: %d stored function(s) in PostgreSQL", len(self))

    def _connect(self) -> Any:
        return self._psycopg.connect(self.url, connect_timeout=self._connect_timeout)

    def _connection(self) -> Any:
        """The connection, opened again if the last one broke (a database restart)."""
        if self._conn.closed or self._conn.broken:
            log.warning("store: PostgreSQL connection lost; reconnecting")
            with contextlib.suppress(Exception):
                self._conn.close()
            self._conn = self._connect()
        return self._conn

    # -- SqlStore ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _write(self) -> Iterator[Any]:
        with self._mutex:
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cur:
                cur.execute("SELECT pg_advisory_xact_lock(%s)", (_LOCK_KEY,))
                yield cur
                cur.execute(f"NOTIFY {_CHANNEL}")

    @contextlib.contextmanager
    def _read(self) -> Iterator[Any]:
        with self._mutex:
            conn = self._connection()
            with conn.transaction(), conn.cursor() as cur:
                yield cur

    def _is_full(self, exc: BaseException) -> bool:
        # 53100 disk_full, 53400 configuration_limit_exceeded (e.g. temp_file_limit)
        return getattr(exc, "sqlstate", None) in ("53100",)

    def _is_unavailable(self, exc: BaseException) -> bool:
        # the server is down, restarting or unreachable; the next call reconnects
        return isinstance(exc, self._psycopg.OperationalError)

    def maybe_changed(self) -> bool:
        if self._hint.is_set():
            self._hint.clear()
            return True
        return False

    def close(self) -> None:
        self._closed.set()
        with self._mutex, contextlib.suppress(Exception):
            self._conn.close()
        self._listener.join(timeout=3)

    # -- notifications -------------------------------------------------------------------
    def _listen(self) -> None:
        """Set the hint on every notification; reconnect (hinting) after a failure."""
        while not self._closed.is_set():
            try:
                conn = self._psycopg.connect(self.url, autocommit=True,
                                             connect_timeout=self._connect_timeout)
            except Exception as exc:
                log.warning("store: cannot listen for changes (%s); retrying", exc)
                self._closed.wait(1.0)
                continue
            try:
                with conn:
                    conn.execute(f"LISTEN {_CHANNEL}")
                    self._hint.set()  # changes while not listening are read now
                    while not self._closed.is_set():
                        for _ in conn.notifies(timeout=0.5, stop_after=1):
                            self._hint.set()
            except Exception as exc:
                if not self._closed.is_set():
                    log.warning("store: change listener failed (%s); reconnecting", exc)
                    self._hint.set()
                    self._closed.wait(0.5)
