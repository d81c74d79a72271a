"""The store's limits and a full store, in one process (the default suite).

* ``store.admit_put`` is the one rule for the function limit (429) and the quota (507),
  applied by every backend inside its own lock or transaction: two connections to one
  SQLite file, from many threads, store exactly the limit;
* a full SQLite store can always be freed: deleting is never refused by a limit, a
  database SQLite itself reports full (``max_page_count``) deletes, and so does one on a
  real full file system (a tmpfs: needs root and ``mount``, skipped elsewhere), before and
  after it is opened again; the write-ahead log stays small through many writes;
* over HTTP: a server with its quota reached answers DELETE with 200, frees the bytes,
  registers again, and does all that again after a restart.

The same limits across server processes (``--workers 2``, two servers, PostgreSQL) are
in ``tests/cluster/test_store_limits_cluster.py``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import subprocess
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from dxcontract.errors import StorageFullError, TooManyFunctionsError
from dxserve.server.stores import open_store
from dxserve.server.stores.sqlite import WAL_LIMIT_BYTES, SqliteStore
from tests.conftest import start_server, stop_server

E = b'{"args": ["x"], "expression": "jnp.sum(x ** %d)"}'


def blob(i: int, size: int) -> bytes:
    """``size`` bytes unique to ``i`` (incompressible, so pages are really used)."""
    return i.to_bytes(4, "big") + os.urandom(size - 4)


def wal_bytes(db: Path) -> int:
    wal = db.with_name(db.name + "-wal")
    return wal.stat().st_size if wal.exists() else 0


def rows(db: Path) -> tuple[int, int]:
    """(functions, bytes of objects) as committed in an SQLite store."""
    with contextlib.closing(sqlite3.connect(db)) as conn:
        names = conn.execute("SELECT COUNT(*) FROM functions").fetchone()[0]
        used = conn.execute("SELECT COALESCE(SUM(size), 0) FROM objects").fetchone()[0]
    return names, used


# --- the rule -----------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["dir", "sqlite"])
def test_one_rule_for_the_function_limit_and_the_quota(tmp_path: Path, backend: str) -> None:
    spec = f"dir://{tmp_path}/s" if backend == "dir" else str(tmp_path / "s")
    with open_store(spec, quota_bytes=1000) as s:
        s.put("a", "export", b"a" * 300, {}, max_functions=2)
        s.put("b", "export", b"b" * 300, {}, max_functions=2)
        with pytest.raises(TooManyFunctionsError) as info:
            s.put("c", "export", b"c" * 10, {}, max_functions=2)
        assert info.value.field == "name" and "DXSERVE_MAX_FUNCTIONS" in info.value.detail
        assert "limit of 2 functions" in info.value.detail
        # at the limit, names already held may still be re-put and replaced
        assert s.put("a", "export", b"a" * 300, {}, max_functions=2)[1] is False
        s.put("a", "export", b"A" * 600, {}, replace=True, max_functions=2)
        assert s.used_bytes == 900 and len(s) == 2
        with pytest.raises(StorageFullError) as full:
            s.put("b", "export", b"B" * 450, {}, replace=True)  # 900 - 300 + 450 > 1000
        assert "DXSERVE_STORE_QUOTA_BYTES" in full.value.detail and full.value.field == "body"
        s.delete("b")
        s.put("c", "export", b"c" * 10, {}, max_functions=2)  # a slot and bytes again
        assert sorted(r.name for r in s.records()) == ["a", "c"] and s.used_bytes == 610
    # the quota lowered below what is stored: a put that adds no bytes is still allowed
    with open_store(spec, quota_bytes=100) as s:
        assert s.used_bytes == 610
        s.put("a", "export", b"a" * 95, {}, replace=True)  # shrinks, still over: allowed
        assert s.used_bytes == 105
        with pytest.raises(StorageFullError):
            s.put("d", "export", b"d", {})
        assert s.delete("a") and s.delete("c") and s.used_bytes == 0


def test_the_limit_is_exact_over_two_connections_and_16_threads(tmp_path: Path) -> None:
    """Two connections to one file stand for two processes: SQLite's write lock, not a
    process's own count, decides."""
    cap, tries = 7, 32
    one, two = SqliteStore(tmp_path / "s"), SqliteStore(tmp_path / "s")
    barrier = threading.Barrier(16)

    def put(i: int) -> str:
        if i < 16:
            barrier.wait(timeout=30)
        try:
            (one if i % 2 else two).put(f"f{i}", "expression", E % i, {}, max_functions=cap)
            return "ok"
        except TooManyFunctionsError:
            return "429"

    try:
        with ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(put, range(tries)))
        assert outcomes.count("ok") == cap and outcomes.count("429") == tries - cap
        assert len(one) == len(two) == cap == rows(one.path)[0]
    finally:
        one.close()
        two.close()


# --- a full SQLite database ------------------------------------------------------------------
def test_a_database_sqlite_reports_full_is_freed_by_delete(tmp_path: Path) -> None:
    """``max_page_count`` makes SQLite itself answer SQLITE_FULL, as on a full disk."""
    with SqliteStore(tmp_path / "s") as s:
        pages = s._conn.execute("PRAGMA page_count").fetchone()[0]
        s._conn.execute(f"PRAGMA max_page_count = {pages + 60}")  # about 240 KiB more
        stored = 0
        with pytest.raises(StorageFullError, match="no space left"):
            for i in range(1000):
                s.put(f"f{i}", "export", blob(i, 20_000), {})
                stored += 1
        assert 5 <= stored < 1000 and len(s) == stored
        for i in range(3):  # deleting needs no more room than it frees
            assert s.delete(f"f{i}")
        assert len(s) == stored - 3
        s.put("again", "export", blob(-1 & 0xFFFF, 20_000), {})  # the freed pages are used
        assert s.get("again") is not None and s.get("f3") is not None


def test_the_write_ahead_log_stays_small(tmp_path: Path) -> None:
    size = 300_000
    with SqliteStore(tmp_path / "s") as s:
        s.put("keep", "export", blob(0, size), {})
        largest = 0
        for i in range(1, 80):
            s.put(f"f{i}", "export", blob(i, size), {})
            largest = max(largest, wal_bytes(s.path))
            if i % 2:
                s.delete(f"f{i}")
                assert wal_bytes(s.path) == 0  # checkpointed and truncated after a delete
        # never more than the cut-back size plus one put's pages
        assert largest <= WAL_LIMIT_BYTES + 2 * size, largest
        for i in range(2, 80, 2):
            s.delete(f"f{i}")
        # the freed pages went back to the file system: about one function's pages left
        assert s.path.stat().st_size < 3 * size, s.path.stat().st_size
        assert s.get("keep").content[:4] == (0).to_bytes(4, "big")


def test_a_delete_on_a_full_disk_takes_the_reserve_and_tries_again(tmp_path: Path) -> None:
    """The retry path, with the first attempt failing as a full disk does; the real
    disk is ``test_a_real_full_file_system_is_freed_and_reopened``."""
    with SqliteStore(tmp_path / "s") as s:
        s.put("f", "expression", E % 2, {})
        assert s.reserve_path.stat().st_size == s.reserve_bytes > 0
        real, calls = s._delete, []

        def full_once(name: str) -> bool:
            calls.append(name)
            if len(calls) == 1:
                raise StorageFullError("no space left (simulated)")
            return real(name)

        s._delete = full_once
        assert s.delete("f") and calls == ["f", "f"] and len(s) == 0
        assert s.reserve_path.exists()  # released, then made again: the disk has room


# --- a real full file system -----------------------------------------------------------------
@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 2 MiB tmpfs (needs root and mount); skipped where it cannot be mounted."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave: int = 0) -> Path:
    """Write a file in ``path``'s file system until at most ``leave`` bytes are free."""
    for n in range(1000):
        filler = path / f"filler{n}"
        if not filler.exists():
            break
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
    try:
        while free_bytes(path) > leave:
            os.write(fd, b"\xa5" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_real_full_file_system_is_freed_and_reopened(tiny_fs: Path) -> None:
    s = SqliteStore(tiny_fs / "store")
    try:
        assert s.reserve_path.exists()
        stored = 0
        with pytest.raises(StorageFullError, match="no space left"):
            for i in range(1000):
                s.put(f"f{i}", "export", blob(i, 30_000), {})
                stored += 1
        fill(tiny_fs)  # and then something else takes the last byte
        assert free_bytes(tiny_fs) == 0
        db_before = s.path.stat().st_size
        for i in range(4):
            assert s.delete(f"f{i}")
        assert s.path.stat().st_size <= db_before - 4 * 30_000  # given back to the disk
        assert free_bytes(tiny_fs) > 0
        for i in range(4, stored):  # until there is room for the reserve and one more
            if s.reserve_path.exists() and free_bytes(tiny_fs) > 3 * 30_000:
                break
            assert s.delete(f"f{i}")
        s.put("again", "export", blob(9999, 30_000), {})
        assert s.get("again") is not None
    finally:
        s.close()
    fill(tiny_fs)  # full again while closed: opening needs room for its index file
    assert free_bytes(tiny_fs) == 0
    with SqliteStore(tiny_fs / "store") as s:
        left = len(s)
        assert left > 0 and s.get("again") is not None
        name = next(r.name for r in s.records() if r.name != "again")
        assert s.delete(name) and len(s) == left - 1 and free_bytes(tiny_fs) > 0


# --- over HTTP ------------------------------------------------------------------------------
def _register(url: str, name: str, expression: str) -> httpx.Response:
    return httpx.post(f"{url}/functions", json={"name": name, "expression": expression})


@pytest.mark.slow
def test_a_server_at_its_quota_deletes_registers_and_restarts(tmp_path: Path) -> None:
    content = len(b'{"args": ["x"], "expression": "jnp.sum(x) * 1000"}')
    fit = 5
    store = tmp_path / "store"
    env = {"DXSERVE_STORE_QUOTA_BYTES": str(content * fit), "DXSERVE_WARM_UP": "false"}
    srv = start_server(tmp_path / "a", env=env, args=["--store", str(store)],
                       modules=("dxserve.examples",))
    try:
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(
                lambda i: _register(srv.url, f"e{i}", f"jnp.sum(x) * {1000 + i}"), range(12)))
        codes = [r.status_code for r in answers]
        assert codes.count(201) == fit and codes.count(507) == 12 - fit, codes
        assert rows(store / "store.db") == (fit, content * fit)
        kept = [f"e{i}" for i, r in enumerate(answers) if r.status_code == 201]
        gone = httpx.delete(f"{srv.url}/functions/{kept[0]}")
        assert gone.status_code == 200 and gone.json() == {"deleted": kept[0]}
        assert rows(store / "store.db") == (fit - 1, content * (fit - 1))
        assert _register(srv.url, "later", "jnp.sum(x) * 1234").status_code == 201
        assert _register(srv.url, "more", "jnp.sum(x) * 1235").status_code == 507
    finally:
        stop_server(srv)
    srv = start_server(tmp_path / "b", env=env, args=["--store", str(store)],
                       modules=("dxserve.examples",))
    try:  # started on the full store: deleting works, and frees room again
        assert rows(store / "store.db") == (fit, content * fit)
        assert httpx.delete(f"{srv.url}/functions/{kept[1]}").status_code == 200
        assert _register(srv.url, "after", "jnp.sum(x) * 1236").status_code == 201
        assert httpx.delete(f"{srv.url}/functions/{kept[2]}").status_code == 200
        # many writes and deletes later the log is still small
        for i in range(40):
            assert _register(srv.url, "churn", f"jnp.sum(x) * {2000 + i}").status_code == 201
            assert httpx.delete(f"{srv.url}/functions/churn").status_code == 200
        assert wal_bytes(store / "store.db") <= WAL_LIMIT_BYTES
    finally:
        stop_server(srv)


@pytest.mark.slow
def test_a_server_on_a_full_disk_deletes_registers_and_restarts(tmp_path: Path,
                                                                  tiny_fs: Path) -> None:
    store = tiny_fs / "store"
    args = ["--store", str(store)]
    env = {"DXSERVE_WARM_UP": "false"}
    srv = start_server(tmp_path / "a", env=env, args=args, modules=("dxserve.examples",))
    # a long expression: about 3 KiB of content each
    terms = " + ".join(
        "(" + " + ".join(f"jnp.sin(x[0] * {g}.{k}5)" for k in range(10)) + ")" for g in range(14)
    )
    try:
        fill(tiny_fs, leave=(store / "store.db-reserve").stat().st_size // 2 + 160_000)
        stored = []
        for i in range(200):
            r = _register(srv.url, f"f{i}", f"jnp.sum(x) * {i} + {terms}")
            if r.status_code == 507:
                assert r.json()["type"].endswith("insufficient-storage")
                assert "no space left" in r.json()["detail"]
                break
            assert r.status_code == 201, r.text
            stored.append(f"f{i}")
        assert len(stored) >= 5
        fill(tiny_fs)
        assert free_bytes(tiny_fs) == 0
        size = (store / "store.db").stat().st_size
        for name in stored[:3]:
            r = httpx.delete(f"{srv.url}/functions/{name}")
            assert r.status_code == 200, r.text
        assert (store / "store.db").stat().st_size < size and free_bytes(tiny_fs) > 0
        for name in stored[3:]:  # until the reserve is back and a registration fits
            if (store / "store.db-reserve").exists() and free_bytes(tiny_fs) > 64_000:
                break
            assert httpx.delete(f"{srv.url}/functions/{name}").status_code == 200
            stored.remove(name)
        r = _register(srv.url, "again", f"jnp.sum(x) * -1 + {terms}")
        assert r.status_code == 201, r.text
    finally:
        stop_server(srv)
    fill(tiny_fs)
    assert free_bytes(tiny_fs) == 0
    srv = start_server(tmp_path / "b", env=env, args=args, modules=("dxserve.examples",))
    try:  # it starts on the full disk, and a delete works and frees room
        assert "released the reserve to open it" in srv.log.read_text()
        assert httpx.get(f"{srv.url}/functions/again").status_code == 200
        r = httpx.delete(f"{srv.url}/functions/again")
        assert r.status_code == 200, r.text
        assert httpx.get(f"{srv.url}/functions/again").status_code == 404
        assert free_bytes(tiny_fs) > 0
    finally:
        stop_server(srv)
