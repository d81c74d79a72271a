"""The embedded shared store: one SQLite database in WAL mode (``<store>/store.db``).

Several processes on one machine open the same file: SQLite's locks serialize the
writers (``BEGIN IMMEDIATE``, waiting up to ``busy_timeout``) while readers never block
(WAL). Contents are blobs in the same database, so a name and its object commit in one
transaction.

Durability: ``synchronous=FULL`` in WAL mode fsyncs the WAL at every commit, so a
registration acknowledged to a client survives SIGKILL of any process and a power
loss. (NORMAL would survive a killed process but may lose the last commits on power
loss; registrations are rare, so FULL costs nothing that matters.)

Staying current: ``PRAGMA data_version`` changes when another connection commits and
costs no table read, so ``maybe_changed`` is nearly free and the registry asks
``changes`` only when it says so.

Migration: a directory store (``names/`` and ``objects/``, the format of
``store.DirectoryStore``) found in the same directory is imported once, in one
transaction, the first time the database is opened; its files are left as they were.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .sql import SqlStore

log = logging.getLogger("dxserve.store")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS functions (
    name TEXT PRIMARY KEY, kind TEXT NOT NULL, digest TEXT NOT NULL, size INTEGER NOT NULL,
    metadata TEXT NOT NULL, created TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS functions_digest ON functions (digest);
CREATE TABLE IF NOT EXISTS objects (
    digest TEXT PRIMARY KEY, content BLOB NOT NULL, size INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS changes (seq INTEGER PRIMARY KEY AUTOINCREMENT, name TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

DB_NAME = "store.db"


class SqliteStore(SqlStore):
    """``FunctionStore`` in one SQLite file shared by the processes of one machine.

    ``path``: the database file, or a directory to hold ``store.db``. ``busy_timeout``:
    seconds a writer waits for another process's write transaction.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        quota_bytes: int | None = None,
        busy_timeout: float = 30.0,
    ) -> None:
        super().__init__(quota_bytes=quota_bytes)
        path = Path(path)
        if path.suffix not in (".db", ".sqlite", ".sqlite3"):
            path = path / DB_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.root = path.parent
        # autocommit off by hand (isolation_level=None): each write is an explicit
        # BEGIN IMMEDIATE ... COMMIT, reads are single statements.
        self._conn = sqlite3.connect(
            path, timeout=busy_timeout, isolation_level=None, check_same_thread=False
        )
        self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
        mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
        if mode.lower() != "wal":  # e.g. a network file system without shared memory
            raise RuntimeError(f"function store {path}: SQLite refused WAL mode ({mode})")
        self._conn.execute("PRAGMA synchronous = FULL")
        for statement in filter(str.strip, _SCHEMA.split(";")):
            self._conn.execute(statement)
        self._data_version = -1
        self._migrate_directory()
        log.info("store: %d function(s) in %s (SQLite, WAL)", len(self), path)

    # -- SqlStore ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        with self._mutex:
            cur = self._conn.cursor()
            cur.execute("BEGIN IMMEDIATE")  # takes the write lock now, so reads inside are current
            try:
                yield cur
            except BaseException:
                with contextlib.suppress(sqlite3.Error):
                    cur.execute("ROLLBACK")
                raise
            else:
                cur.execute("COMMIT")
            finally:
                cur.close()

    @contextlib.contextmanager
    def _read(self) -> Iterator[sqlite3.Cursor]:
        with self._mutex:
            cur = self._conn.cursor()
            try:
                yield cur
            finally:
                cur.close()

    def _is_full(self, exc: BaseException) -> bool:
        code = getattr(exc, "sqlite_errorcode", None)
        return code == sqlite3.SQLITE_FULL or (
            isinstance(exc, OSError) and exc.errno in (28, 122)  # ENOSPC, EDQUOT
        )

    def _is_unavailable(self, exc: BaseException) -> bool:
        # another process held the write lock past busy_timeout
        return isinstance(exc, sqlite3.OperationalError) and "locked" in str(exc)

    def maybe_changed(self) -> bool:
        with self._mutex:
            version = self._conn.execute("PRAGMA data_version").fetchone()[0]
            changed, self._data_version = version != self._data_version, version
        return changed

    def close(self) -> None:
        with self._mutex:
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()

    # -- migration -----------------------------------------------------------------------
    def _migrate_directory(self) -> None:
        if not (self.root / "names").is_dir():
            return
        if self._query("SELECT value FROM meta WHERE key = 'directory_migrated'") is not None:
            return
        from ..store import DirectoryStore

        # lock=False: reads only (a directory store still served by an old process is
        # imported as it stands; that process keeps its own copy).
        old = DirectoryStore(self.root, lock=False)
        try:
            moved = self._import(old)
        finally:
            old.close()
            del old  # collected now, not at interpreter exit
        log.info("store: imported %d function(s) from the directory store in %s", moved, self.root)

    def _import(self, old: Any) -> int:
        moved = 0
        with self._writing() as cur:
            cur.execute("SELECT value FROM meta WHERE key = 'directory_migrated'")
            if cur.fetchone() is not None:  # another process migrated it meanwhile
                return 0
            for rec in old.records():
                full = old.get(rec.name)
                if full is None:
                    continue
                cur.execute("SELECT 1 FROM functions WHERE name = ?", (rec.name,))
                if cur.fetchone() is not None:
                    continue
                cur.execute(
                    "INSERT OR IGNORE INTO objects (digest, content, size) VALUES (?, ?, ?)",
                    (full.digest, full.content, len(full.content)),
                )
                cur.execute(
                    "INSERT INTO functions (name, kind, digest, size, metadata, created) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (rec.name, rec.kind, rec.digest, rec.size, _json(rec.metadata), rec.created),
                )
                self._log_change(cur, rec.name)
                moved += 1
            cur.execute("INSERT INTO meta (key, value) VALUES ('directory_migrated', ?)",
                        (str(moved),))
        return moved


def _json(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
