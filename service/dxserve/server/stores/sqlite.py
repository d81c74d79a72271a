"""The embedded shared store: one SQLite database in WAL mode (``<store>/store.db``).

Several processes on one machine open the same file: SQLite's locks serialize the
writers (``BEGIN IMMEDIATE``, waiting up to ``busy_timeout``) while readers never block
(WAL). Contents are blobs in the same database, so a name and its object commit in one
transaction.

Durability: ``synchronous=FULL`` in WAL mode fsyncs the WAL at every commit, so a
registration acknowledged to a client survives SIGKILL of any process and a power
loss. (NORMAL would survive a killed process but may lose the last commits on power
loss; registrations are rare, so FULL costs nothing that matters.)

A full disk: deleting must free a full store, yet in WAL mode even a delete writes (a
few pages to the log), and opening a store makes its shared-memory index file. So:

* a reserve file, ``store.db-reserve`` (``RESERVE_BYTES``, or a 16th of a small disk),
  is kept next to the database; a delete (or an open) that finds the disk full
  releases it and tries once more, and it is made again, before freed room goes to
  new functions, once the disk has room for it;
* a put needs twice its size free (the log, then the database, hold it until the
  checkpoint), plus the reserve while that is missing, else 507: the store's own
  writes never fill the disk;
* after a delete the freed pages go back to the file system (``auto_vacuum =
  INCREMENTAL``, in steps that each need little free space) and the log is truncated
  (``wal_checkpoint(TRUNCATE)``). The log is also checkpointed after every put, at
  open and at close, and cut back to ``WAL_LIMIT_BYTES`` whenever it restarts, so it
  never grows past its largest transaction plus that. A database made before
  auto-vacuum was turned on reuses its freed pages but does not shrink.

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
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dxcontract.errors import StorageFullError
from dxserve.server.stores.sql import SqlStore

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
#: Bytes kept free for deletes: the reserve file, and the margin a put must leave.
RESERVE_BYTES = 4 << 20
#: The reserve on a small disk: the shared-memory index (32 KiB) and a delete's log.
MIN_RESERVE_BYTES = 256 << 10
#: Bytes the write-ahead log's file is cut back to when it restarts.
WAL_LIMIT_BYTES = 4 << 20
#: Seconds a checkpoint waits for other processes' readers and writers (it only tidies).
_CHECKPOINT_WAIT = 2.0


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
        reserve_bytes: int = RESERVE_BYTES,
    ) -> None:
        super().__init__(quota_bytes=quota_bytes)
        path = Path(path)
        if path.suffix not in (".db", ".sqlite", ".sqlite3"):
            path = path / DB_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.root = path.parent
        self.reserve_path = path.with_name(path.name + "-reserve")
        #: Bytes kept for deletes: ``reserve_bytes``, or a 16th of a smaller disk but at
        #: least what opening the store and a few deletes need.
        self.reserve_bytes = min(reserve_bytes, max(MIN_RESERVE_BYTES, self._disk_bytes() // 16))
        self._busy_ms = int(busy_timeout * 1000)
        try:
            self._conn = self._connect()
        except sqlite3.Error:
            # Opening makes the shared-memory index file (and the schema of a new
            # database): on a full disk the reserve makes that room, once.
            if self._free_disk() >= self.reserve_bytes or not self._make_room():
                raise
            log.warning("store: %s: the disk is full; released the reserve to open it", path)
            self._conn = self._connect()
        self._data_version = -1
        self._migrate_directory()
        self._compact()  # a log left by a full disk or a killed process is folded in now
        self._keep_reserve()
        log.info("store: %d stored function(s) in %s (SQLite, WAL)", len(self), path)

    def _connect(self) -> sqlite3.Connection:
        # autocommit off by hand (isolation_level=None): each write is an explicit
        # BEGIN IMMEDIATE ... COMMIT, reads are single statements.
        conn = sqlite3.connect(
            self.path, timeout=self._busy_ms / 1000, isolation_level=None,
            check_same_thread=False,
        )
        try:
            conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
            # Only a new database takes this (it must precede the first table).
            conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":  # e.g. a network file system without shared memory
                raise RuntimeError(f"function store {self.path}: SQLite refused WAL mode ({mode})")
            conn.execute("PRAGMA synchronous = FULL")
            conn.execute(f"PRAGMA journal_size_limit = {WAL_LIMIT_BYTES}")
            conn.execute("PRAGMA wal_autocheckpoint = 1000")  # pages (SQLite's default)
            for statement in filter(str.strip, _SCHEMA.split(";")):
                conn.execute(statement)
        except BaseException:
            conn.close()
            raise
        return conn

    # -- SqlStore ------------------------------------------------------------------------
    @contextlib.contextmanager
    def _write(self) -> Iterator[sqlite3.Cursor]:
        with self._mutex:
            cur = self._conn.cursor()
            cur.execute("BEGIN IMMEDIATE")  # takes the write lock now, so reads inside are current
            try:
                yield cur
                cur.execute("COMMIT")
            except BaseException:
                # also after a failed COMMIT (a full disk): the connection must not stay
                # inside the transaction, holding the write lock
                with contextlib.suppress(sqlite3.Error):
                    cur.execute("ROLLBACK")
                raise
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
            self._checkpoint("TRUNCATE")
            with contextlib.suppress(sqlite3.Error):
                self._conn.close()

    # -- a full disk ---------------------------------------------------------------------
    def _free_disk(self) -> int:
        """Bytes this process may still write on the store's file system."""
        return shutil.disk_usage(self.root).free

    def _disk_bytes(self) -> int:
        """The size of the store's file system."""
        return shutil.disk_usage(self.root).total

    def _room_for(self, size: int) -> None:
        # Inside the write transaction, so the processes sharing the disk ask in turn.
        # Twice the content: the log holds it until the checkpoint copies it over; and
        # room to make the reserve again while it is missing.
        keep = 0 if self.reserve_path.exists() else self.reserve_bytes
        need = 2 * size + keep
        free = self._free_disk()
        if free < need:
            raise StorageFullError(
                f"the function store's disk has no space left for this: {free} bytes free, and "
                f"storing {size} bytes needs {need} (twice the content while the database's "
                f"write-ahead log holds it, plus {keep} to keep for deletes); delete functions "
                "or free disk",
                field="body",
            )

    def _make_room(self) -> bool:
        try:
            self.reserve_path.unlink()
        except FileNotFoundError:
            return False  # already released, by this process or another
        return True

    def _keep_reserve(self) -> None:
        """Make the reserve file if it is missing and the disk has room for it (and a
        quarter more): it comes back before freed room goes to new functions, since it
        is what lets the store open and delete on a disk that fills up again."""
        if self.reserve_bytes <= 0 or self.reserve_path.exists():
            return
        with contextlib.suppress(OSError):
            if self._free_disk() < self.reserve_bytes * 5 // 4:
                return  # made again once deletes free the room
            tmp = self.reserve_path.with_name(f".{self.reserve_path.name}-{os.getpid()}")
            try:
                with open(tmp, "wb") as f:
                    block = os.urandom(1 << 16)  # not zeros: a compressing file system keeps it
                    for _ in range(0, self.reserve_bytes, len(block)):
                        f.write(block)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.reserve_path)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    tmp.unlink()

    def _after_write(self, *, deleted: bool) -> None:
        if deleted:
            self._compact()
            self._keep_reserve()
        else:
            self._checkpoint("PASSIVE")  # never waits; the next write restarts the log

    def _compact(self) -> None:
        """Give free pages back to the file system and truncate the write-ahead log, in
        steps of at most half the free disk (at least 64 KiB), so each step's log fits
        in what the previous one freed. Best effort: a busy or full disk stops it."""
        try:
            with self._mutex:
                page = self._conn.execute("PRAGMA page_size").fetchone()[0]
                incremental = self._conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
                left = None
                while self._checkpoint("TRUNCATE") and incremental:
                    free = self._conn.execute("PRAGMA freelist_count").fetchone()[0]
                    if not free or (left is not None and free >= left):
                        return  # done, or another process is filling the pages meanwhile
                    left = free
                    step = max(16, self._free_disk() // 2 // page)
                    # its own write transaction; executescript steps the pragma to its
                    # end (a cursor frees one page per execute)
                    self._conn.executescript(f"PRAGMA incremental_vacuum({step});")
        except (sqlite3.Error, OSError) as exc:
            log.info("store: compaction stopped: %s", exc)

    def _checkpoint(self, mode: str) -> bool:
        """``PRAGMA wal_checkpoint(mode)``, waiting at most ``_CHECKPOINT_WAIT`` for other
        processes; True if every frame of the log reached the database."""
        with self._mutex:
            try:
                self._conn.execute(f"PRAGMA busy_timeout = {int(_CHECKPOINT_WAIT * 1000)}")
                busy, frames, done = self._conn.execute(f"PRAGMA wal_checkpoint({mode})").fetchone()
            except sqlite3.Error as exc:
                log.info("store: checkpoint (%s) failed: %s", mode, exc)
                return False
            finally:
                with contextlib.suppress(sqlite3.Error):
                    self._conn.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
        return not busy and frames == done

    # -- migration -----------------------------------------------------------------------
    def _migrate_directory(self) -> None:
        if not (self.root / "names").is_dir():
            return
        if self._query("SELECT value FROM meta WHERE key = 'directory_migrated'") is not None:
            return
        from dxserve.server.stores.directory import DirectoryStore

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
