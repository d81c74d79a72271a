"""What the SQL stores (SQLite, PostgreSQL) share: the schema, the put/delete rules and
the change log other processes follow.

Tables (the same in both databases)::

    functions(name PRIMARY KEY, kind, digest, size, metadata JSON text, created)
    objects(digest PRIMARY KEY, content, size)      one row per referenced content
    changes(seq, name)                               one row per put or delete

Every write is one transaction, serialized across processes (SQLite: ``BEGIN
IMMEDIATE``; PostgreSQL: a transaction-scoped advisory lock), so the 409/``replace``
rules, the function limit and the quota (``store.admit_put``) are decided on what is
committed, never on a process's stale view.
``objects`` holds exactly the contents some name refers to (an object is removed in the
transaction that drops its last name), so the quota check is one ``SUM``.

``changes`` is what keeps every process's registry current without reading everything:
a process remembers the last ``seq`` it applied and asks only for the names changed
since (``changes``). The log keeps the last ``KEEP_CHANGES`` rows; a process further
behind than that gets ``None`` and re-reads every record.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

from dxcontract.errors import (
    OverloadedError,
    StorageFullError,
)
from dxserve.server.stores.directory import (
    StoredFunction,
    StoredRecord,
    _now,
    admit_put,
    checked_put,
    conflict,
    content_digest,
    every_function,
    with_content,
)

log = logging.getLogger("dxserve.store")

#: Rows of ``changes`` kept; a process that has not synced for that many writes re-reads all.
KEEP_CHANGES = 10_000

_FIELDS = "name, kind, digest, size, metadata, created"


class SqlStore:
    """A ``FunctionStore`` over one SQL connection (``put`` rules as ``DirectoryStore``).

    Subclasses provide ``_write`` (a serialized write transaction yielding a cursor),
    ``_read`` (a cursor for reads), ``_is_full`` (is this driver error a full disk) and
    ``_p`` (the driver's placeholder). Every method may be called from any thread.
    """

    #: True: other processes may write this store (the registry follows ``changes``).
    shared = True
    _p = "?"

    def __init__(self, *, quota_bytes: int | None = None) -> None:
        #: Most bytes of distinct objects the names may refer to (None: no limit).
        self.quota_bytes = quota_bytes if quota_bytes and quota_bytes > 0 else None
        self._mutex = threading.RLock()

    # -- for subclasses ----------------------------------------------------------------
    def _write(self) -> contextlib.AbstractContextManager[Any]:  # pragma: no cover
        raise NotImplementedError

    def _read(self) -> contextlib.AbstractContextManager[Any]:  # pragma: no cover
        raise NotImplementedError

    def _is_full(self, exc: BaseException) -> bool:  # pragma: no cover
        raise NotImplementedError

    def _sql(self, statement: str) -> str:
        return statement if self._p == "?" else statement.replace("?", self._p)

    def _is_unavailable(self, exc: BaseException) -> bool:
        """Is this driver error the database being unreachable or busy (try again)?"""
        return False

    def _room_for(self, size: int) -> None:
        """Raise ``StorageFullError`` if the disk cannot take ``size`` more bytes now;
        called inside a put's write transaction (default: the database says so itself)."""

    def _make_room(self) -> bool:
        """Free some disk for a write that found it full (a delete); True if it did."""
        return False

    def _after_write(self, *, deleted: bool) -> None:
        """Housekeeping once a write committed (SQLite: checkpoint the write-ahead log)."""

    @contextlib.contextmanager
    def _writing(self) -> Iterator[Any]:
        """``_write`` with a full disk reported as a 507 and an unreachable or busy
        database as a 503 (nothing was committed in either case)."""
        try:
            with self._write() as cur:
                yield cur
        except Exception as exc:
            if self._is_full(exc):
                raise StorageFullError(
                    "the function store's database has no space left; nothing was stored: "
                    "retry once the operator has freed space"
                ) from exc
            if self._is_unavailable(exc):
                raise OverloadedError(
                    f"the function store is unavailable ({exc}); nothing was stored: retry"
                ) from exc
            raise

    def _query(self, statement: str, params: tuple = (), *, many: bool = False) -> Any:
        """One read: ``fetchall()`` if ``many`` else ``fetchone()``. Sent once more on a
        fresh connection if the database was unreachable (a read is safe to repeat),
        then reported as a 503."""
        for attempt in (0, 1):
            try:
                with self._read() as cur:
                    cur.execute(self._sql(statement), params)
                    return cur.fetchall() if many else cur.fetchone()
            except Exception as exc:
                if not self._is_unavailable(exc):
                    raise
                if attempt:
                    raise OverloadedError(
                        f"the function store is unavailable ({exc}); retry"
                    ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    # -- FunctionStore -----------------------------------------------------------------
    def put(
        self, name: str, kind: str, content: bytes, metadata: dict[str, Any], *,
        replace: bool = False, max_functions: int | None = None,
    ) -> tuple[StoredFunction, bool]:
        """Bind ``name`` to ``content``: the rules of ``DirectoryStore.put``, committed
        (durably, see the backend) before it returns. The function limit and the quota
        (``store.admit_put``) are decided on the committed rows inside the serialized
        write transaction, so every process of every server sharing the store keeps
        them exactly."""
        content, metadata, digest = checked_put(name, kind, content, metadata, self.quota_bytes)
        size = len(content)
        q = self._sql
        with self._writing() as cur:
            cur.execute(q(f"SELECT {_FIELDS} FROM functions WHERE name = ?"), (name,))
            row = cur.fetchone()
            old = _record(row) if row is not None else None
            same = old is not None and old.digest == digest and old.kind == kind
            cur.execute(q("SELECT 1 FROM objects WHERE digest = ?"), (digest,))
            have_object = cur.fetchone() is not None
            if same and not replace:
                if not have_object:  # heals a lost object
                    cur.execute(
                        q("INSERT INTO objects (digest, content, size) VALUES (?, ?, ?)"),
                        (digest, content, size),
                    )
                return with_content(old, content), False
            if old is not None and not same and not replace:
                raise conflict(old)
            frees_old = old is not None and old.digest != digest and self._refs(cur, old.digest) == 1
            admit_put(
                new_name=old is None, max_functions=max_functions,
                names=lambda: self._scalar(cur, "SELECT COUNT(*) FROM functions"),
                growth=(0 if have_object else size) - (old.size if frees_old else 0),
                quota_bytes=self.quota_bytes,
                used=lambda: self._scalar(cur, "SELECT COALESCE(SUM(size), 0) FROM objects"),
            )
            if not have_object:
                self._room_for(size)
            created = old.created if same else _now()
            record = StoredRecord(name, kind, digest, size, metadata, created)
            if not have_object:
                cur.execute(
                    q("INSERT INTO objects (digest, content, size) VALUES (?, ?, ?)"),
                    (digest, content, size),
                )
            meta = json.dumps(metadata, sort_keys=True)
            if old is None:
                cur.execute(
                    q(f"INSERT INTO functions ({_FIELDS}) VALUES (?, ?, ?, ?, ?, ?)"),
                    (name, kind, digest, size, meta, created),
                )
            else:
                cur.execute(
                    q("UPDATE functions SET kind = ?, digest = ?, size = ?, metadata = ?, "
                      "created = ? WHERE name = ?"),
                    (kind, digest, size, meta, created, name),
                )
            if frees_old:
                cur.execute(q("DELETE FROM objects WHERE digest = ?"), (old.digest,))
            self._log_change(cur, name)
        self._after_write(deleted=False)
        return with_content(record, content), not same

    def get(self, name: str) -> StoredFunction | None:
        """The record with its content, hash-checked (None: absent or corrupt)."""
        row = self._query(
            "SELECT f.name, f.kind, f.digest, f.size, f.metadata, f.created, o.content "
            "FROM functions f LEFT JOIN objects o ON o.digest = f.digest WHERE f.name = ?",
            (name,),
        )
        if row is None:
            return None
        rec, content = _record(row[:6]), row[6]
        if content is None or content_digest(bytes(content)) != rec.digest:
            log.warning("store: %r: its object is missing or fails its hash check", name)
            return None
        return with_content(rec, bytes(content))

    def record(self, name: str) -> StoredRecord | None:
        """The name record alone (no content)."""
        row = self._query(f"SELECT {_FIELDS} FROM functions WHERE name = ?", (name,))
        return _record(row) if row is not None else None

    def records(self) -> list[StoredRecord]:
        """Every name record, by name, without content."""
        rows = self._query(f"SELECT {_FIELDS} FROM functions ORDER BY name", many=True)
        return [_record(row) for row in rows]

    def delete(self, name: str) -> bool:
        """Remove ``name`` (False: absent). Never refused by a limit, and a disk too full
        for even this small write is given the backend's reserve (``_make_room``) and
        the delete tried once more: deleting is how a full store is freed."""
        try:
            found = self._delete(name)
        except StorageFullError:
            if not self._make_room():
                raise
            log.warning("store: the disk was full; released the reserve to delete %r", name)
            found = self._delete(name)
        if found:
            self._after_write(deleted=True)
        return found

    def _delete(self, name: str) -> bool:
        q = self._sql
        with self._writing() as cur:
            cur.execute(q("SELECT digest FROM functions WHERE name = ?"), (name,))
            row = cur.fetchone()
            if row is None:
                return False
            cur.execute(q("DELETE FROM functions WHERE name = ?"), (name,))
            if self._refs(cur, row[0]) == 0:
                cur.execute(q("DELETE FROM objects WHERE digest = ?"), (row[0],))
            self._log_change(cur, name)
        return True

    def list(self) -> list[StoredFunction]:
        """Every function with its content (reads every object: prefer ``records``)."""
        return every_function(self)

    @property
    def used_bytes(self) -> int:
        """Bytes of the distinct objects the names refer to (what the quota bounds)."""
        return int(self._query("SELECT COALESCE(SUM(size), 0) FROM objects")[0])

    def __len__(self) -> int:
        return int(self._query("SELECT COUNT(*) FROM functions")[0])

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.record(name) is not None

    def __enter__(self) -> SqlStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:  # pragma: no cover - backends close their connections
        raise NotImplementedError

    # -- change log --------------------------------------------------------------------
    def generation(self) -> int:
        """The newest change's sequence number (0: none yet)."""
        return int(self._query("SELECT COALESCE(MAX(seq), 0) FROM changes")[0])

    def changes(self, since: int) -> tuple[int, list[str] | None]:
        """``(newest seq, names changed after seq since)``; the names are None when the
        log no longer reaches back to ``since`` (re-read every record then)."""
        rows = self._query("SELECT seq, name FROM changes WHERE seq > ? ORDER BY seq", (since,),
                           many=True)
        if not rows:
            return since, []
        if since > 0 and int(self._query("SELECT MIN(seq) FROM changes")[0]) > since + 1:
            return int(rows[-1][0]), None  # trimmed past since (or a gap): re-read all
        return int(rows[-1][0]), sorted({row[1] for row in rows})

    def maybe_changed(self) -> bool:
        """A cheap hint that another process may have written since the last call
        (False: certainly not; backends without one always say True)."""
        return True

    def _log_change(self, cur: Any, name: str) -> None:
        cur.execute(self._sql("INSERT INTO changes (name) VALUES (?)"), (name,))
        cur.execute("SELECT MAX(seq) FROM changes")
        newest = int(cur.fetchone()[0])
        if newest % 1000 == 0:  # trim now and then, not on every write
            cur.execute(self._sql("DELETE FROM changes WHERE seq <= ?"), (newest - KEEP_CHANGES,))

    def _refs(self, cur: Any, digest: str) -> int:
        return self._scalar(cur, "SELECT COUNT(*) FROM functions WHERE digest = ?", (digest,))

    def _scalar(self, cur: Any, statement: str, params: tuple = ()) -> int:
        """One integer read in the transaction of ``cur``."""
        cur.execute(self._sql(statement), params)
        return int(cur.fetchone()[0])


def _record(row: Any) -> StoredRecord:
    name, kind, digest, size, metadata, created = row
    meta = json.loads(metadata) if isinstance(metadata, str) else dict(metadata)
    return StoredRecord(name, kind, digest, int(size), meta, created)
