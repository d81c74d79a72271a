"""The SQLite store in process (fast, in ``make test``): the put/409/replace rules and
the quota as the directory store has them, a full database as 507, the import of a
directory store, the change log, and two registries on one store seeing each other's
registrations, replacements and deletions (``tests/cluster/test_shared_store.py`` does the same
with real server processes, and PostgreSQL)."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest

from dxcontract.errors import (
    FunctionConflictError,
    PayloadTooLargeError,
    StorageFullError,
    UnknownFunctionError,
)
from dxserve.server.registry import Registry
from dxserve.server.stores import describe_store, open_store
from dxserve.server.stores.directory import DirectoryStore, content_digest
from dxserve.server.stores.sqlite import SqliteStore

E2 = b'{"args": ["x"], "expression": "jnp.sum(x ** 2)"}'
E3 = b'{"args": ["x"], "expression": "jnp.sum(x ** 3)"}'
X = np.array([1.0, 2.0, 3.0])


@pytest.fixture
def store(tmp_path: Path):
    s = open_store(tmp_path / "s")
    yield s
    s.close()


def test_a_path_opens_sqlite_in_wal_mode(tmp_path: Path) -> None:
    for spec in (tmp_path / "a", f"sqlite://{tmp_path}/b", f"sqlite://{tmp_path}/c/x.db"):
        with open_store(spec) as s:
            assert isinstance(s, SqliteStore)
            assert s._conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
            assert s._conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert (tmp_path / "c" / "x.db").exists()
    with open_store(f"dir://{tmp_path}/d") as s:
        assert isinstance(s, DirectoryStore)
    with pytest.raises(ValueError, match="unknown scheme"):
        open_store("redis://localhost/0")
    assert describe_store("postgresql://u:secret@h/db") == "postgresql://u:***@h/db"


def test_put_rules(store) -> None:
    rec, created = store.put("f", "expression", E2, {"description": "a"})
    assert created and rec.digest == content_digest(E2)
    again, created = store.put("f", "expression", E2, {"description": "ignored"})
    assert not created and again.metadata == {"description": "a"}
    same, created = store.put("f", "expression", E2, {"description": "b"}, replace=True)
    assert not created and same.metadata == {"description": "b"} and same.created == rec.created
    with pytest.raises(FunctionConflictError):
        store.put("f", "expression", E3, {})
    swapped, created = store.put("f", "expression", E3, {}, replace=True)
    assert created and swapped.digest == content_digest(E3)
    assert store.get("f").content == E3
    store.put("g", "expression", E3, {})  # shares f's object: counted once
    assert store.used_bytes == len(E3) and len(store) == 2
    assert store.delete("f") and not store.delete("f")
    assert store.get("g").content == E3 and store.used_bytes == len(E3)
    assert store.delete("g") and store.used_bytes == 0
    assert [r.name for r in store.records()] == []


def test_quota_and_a_full_database_are_507(tmp_path: Path) -> None:
    with open_store(tmp_path / "q", quota_bytes=len(E2) + 10) as s:
        s.put("a", "expression", E2, {})
        with pytest.raises(StorageFullError):
            s.put("b", "expression", E3, {})
        with pytest.raises(PayloadTooLargeError):
            s.put("c", "expression", E2 * 2, {})
        s.put("a", "expression", E3, {}, replace=True)  # the old object's bytes are freed
    with open_store(tmp_path / "full") as s:
        pages = s._conn.execute("PRAGMA page_count").fetchone()[0]
        s._conn.execute(f"PRAGMA max_page_count = {pages + 2}")  # the disk is "full"
        big = b'{"args": ["x"], "expression": "jnp.sum(x) + %s"}' % (b"0 + " * 20000 + b"0")
        with pytest.raises(StorageFullError):
            s.put("big", "expression", big, {})
        assert s.get("big") is None and len(s) == 0  # nothing stored
        s.put("small", "expression", E2, {})  # and the store still works


def test_a_directory_store_is_imported_once(tmp_path: Path) -> None:
    with DirectoryStore(tmp_path) as old:
        old.put("f", "expression", E2, {"description": "legacy"})
        old.put("g", "expression", E3, {})
    with open_store(tmp_path) as s:
        assert sorted(r.name for r in s.records()) == ["f", "g"]
        assert s.get("f").metadata == {"description": "legacy"}
        s.delete("g")
    with open_store(tmp_path) as s:  # not imported again: g stays deleted
        assert [r.name for r in s.records()] == ["f"]


def test_the_change_log(store) -> None:
    seq0 = store.generation()
    store.put("a", "expression", E2, {})
    store.put("b", "expression", E3, {})
    store.delete("a")
    seq, names = store.changes(seq0)
    assert seq == store.generation() and names == ["a", "b"]
    assert store.changes(seq) == (seq, [])
    other = open_store(store.path)
    try:
        assert other.maybe_changed()  # first call: unknown, so yes
        assert not other.maybe_changed()
        store.put("c", "expression", E2, {})
        assert other.maybe_changed()  # another connection committed
    finally:
        other.close()


def test_two_registries_on_one_store(tmp_path: Path) -> None:
    sa, sb = open_store(tmp_path), open_store(tmp_path)
    a = Registry(sa, sync_interval=0.0)
    b = Registry(sb, sync_interval=3600.0)  # never due: only read-through and force
    a.load_store()
    b.load_store()
    a.register("sq", "expression", E2, "squares")
    entry = b.get("sq")  # unknown to b: read through
    assert entry.description == "squares"
    np.testing.assert_allclose(entry.fn(X), 14.0)
    removed: list[str] = []
    b.on_remove.append(lambda e: removed.append(e.name))
    a.register("sq", "expression", E3, replace=True)
    np.testing.assert_allclose(b.get("sq").fn(X), 14.0)  # b's interval has not passed
    b.refresh(force=True)
    np.testing.assert_allclose(b.get("sq").fn(X), 36.0)
    assert removed == ["sq"]  # what b had built of the old content was dropped
    a.delete("sq")
    b.refresh(force=True)
    with pytest.raises(UnknownFunctionError):
        b.get("sq")
    with pytest.raises(FunctionConflictError):  # decided on the store, not b's view
        a.register("n", "expression", E2)
        b.register("n", "expression", E3)
    sa.close()
    sb.close()


def test_concurrent_writers_in_two_connections(tmp_path: Path) -> None:
    stores = [open_store(tmp_path), open_store(tmp_path)]
    errors: list[BaseException] = []

    def write(s, k: int) -> None:
        try:
            for i in range(20):
                expr = b'{"args": ["x"], "expression": "jnp.sum(x) * %d"}' % (100 * k + i)
                s.put(f"w{k}_{i}", "expression", expr, {})
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(s, k)) for k, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(stores[0]) == 40 == len(stores[1])
    for s in stores:
        s.close()
    with sqlite3.connect(tmp_path / "store.db") as db:  # integrity after both
        assert db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_worker_settings() -> None:
    from dxserve.settings import Settings

    assert Settings(worker_devices="0,1").worker_devices == ["0", "1"]
    assert Settings(worker_devices="0;0;1,2").worker_devices == ["0", "0", "1,2"]  # ";" wins
    assert Settings(workers=4).workers == 4
    with pytest.raises(ValueError):
        Settings(workers=0)
    assert Settings(store=Path("/tmp/x")).store == "/tmp/x"
