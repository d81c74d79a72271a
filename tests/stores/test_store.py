"""Tests for the persistent, content-addressed function store (dxserve.server.stores.directory)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from dxcontract.errors import FunctionConflictError, InvalidArgumentError
from dxserve.server.stores.directory import (
    DirectoryStore,
    FunctionStore,
    StoredFunction,
    StoreLockedError,
    content_digest,
)

EXPR = b'{"expression": "jnp.sum(jnp.sin(x)**2)", "args": ["x"]}'
EXPR2 = b'{"expression": "jnp.sum(x**3)", "args": ["x"]}'


def hexof(content: bytes) -> str:
    return hashlib.sha256(content).hexdigest()


@pytest.fixture
def store(tmp_path: Path):
    s = DirectoryStore(tmp_path / "store")
    yield s
    s.close()


def reopen(s: DirectoryStore) -> DirectoryStore:
    s.close()
    return DirectoryStore(s.root)


# --- basics ---------------------------------------------------------------
def test_layout_and_protocol(tmp_path: Path) -> None:
    with DirectoryStore(tmp_path / "deep" / "store") as s:
        assert isinstance(s, FunctionStore)
        assert (s.root / "objects").is_dir()
        assert (s.root / "names").is_dir()
        rec, new = s.put("f", "expression", EXPR, {"description": "sin^2"})
        assert new
        assert (s.root / "objects" / hexof(EXPR)).read_bytes() == EXPR
        doc = json.loads((s.root / "names" / "f.json").read_text())
        assert doc["name"] == "f"
        assert doc["kind"] == "expression"
        assert doc["digest"] == "sha256:" + hexof(EXPR) == rec.digest
        assert doc["metadata"] == {"description": "sin^2"}
        assert doc["created"] == rec.created


def test_put_get_list_delete(store: DirectoryStore) -> None:
    rec, new = store.put("b", "expression", EXPR, {"description": "one", "signature": [1]})
    assert new
    assert isinstance(rec, StoredFunction)
    assert rec.name == "b"
    assert rec.kind == "expression"
    assert rec.content == EXPR
    assert rec.digest == content_digest(EXPR)
    assert rec.metadata == {"description": "one", "signature": [1]}
    assert rec.created.endswith("Z") and "T" in rec.created
    store.put("a", "export", b"\x00\x01binary", {})
    assert len(store) == 2
    assert "a" in store
    assert store.get("b") == rec
    assert store.get("missing") is None
    assert [r.name for r in store.list()] == ["a", "b"]
    assert store.delete("b") is True
    assert store.delete("b") is False
    assert store.get("b") is None
    assert len(store) == 1
    assert not (store.root / "names" / "b.json").exists()
    assert not (store.root / "objects" / hexof(EXPR)).exists()


def test_delete_keeps_shared_object(store: DirectoryStore) -> None:
    store.put("f", "expression", EXPR, {})
    store.put("g", "expression", EXPR, {})
    assert store.delete("f")
    assert (store.root / "objects" / hexof(EXPR)).exists()
    assert store.get("g").content == EXPR
    store = reopen(store)
    assert store.get("g").content == EXPR
    assert store.delete("g")
    assert not (store.root / "objects" / hexof(EXPR)).exists()
    store.close()


def test_idempotent_reput(store: DirectoryStore) -> None:
    first, new = store.put("f", "expression", EXPR, {"description": "a"})
    assert new
    again, new = store.put("f", "expression", EXPR, {"description": "ignored"})
    assert not new
    assert again == first  # metadata not updated without replace
    assert len(store) == 1


def test_replace_same_content_updates_metadata(store: DirectoryStore) -> None:
    first, _ = store.put("f", "expression", EXPR, {"description": "a"})
    rec, new = store.put("f", "expression", EXPR, {"description": "b"}, replace=True)
    assert not new
    assert rec.metadata == {"description": "b"}
    assert rec.created == first.created
    store = reopen(store)
    assert store.get("f").metadata == {"description": "b"}
    store.close()


def test_conflict(store: DirectoryStore) -> None:
    store.put("f", "expression", EXPR, {})
    with pytest.raises(FunctionConflictError) as ei:
        store.put("f", "expression", EXPR2, {})
    assert ei.value.field == "name"
    from dxserve.http.problems import status_of  # store errors carry no HTTP status

    assert type(ei.value) is FunctionConflictError and status_of(ei.value) == 409
    # same bytes but another kind is also a conflict
    with pytest.raises(FunctionConflictError):
        store.put("f", "export", EXPR, {})
    assert store.get("f").content == EXPR
    assert not (store.root / "objects" / hexof(EXPR2)).exists()


def test_replace_swaps_content(store: DirectoryStore) -> None:
    store.put("f", "expression", EXPR, {"description": "old"})
    rec, new = store.put("f", "expression", EXPR2, {"description": "new"}, replace=True)
    assert new
    assert rec.content == EXPR2
    assert store.get("f").content == EXPR2
    assert not (store.root / "objects" / hexof(EXPR)).exists()  # old object collected
    store = reopen(store)
    assert store.get("f").content == EXPR2
    assert store.get("f").metadata == {"description": "new"}
    store.close()


def test_replace_on_new_name_is_a_plain_put(store: DirectoryStore) -> None:
    _, new = store.put("f", "expression", EXPR, {}, replace=True)
    assert new


def test_returned_metadata_is_a_copy(store: DirectoryStore) -> None:
    md = {"description": "x", "signature": {"shape": [3]}}
    rec, _ = store.put("f", "expression", EXPR, md)
    md["signature"]["shape"].append(4)
    rec.metadata["description"] = "mutated"
    assert store.get("f").metadata == {"description": "x", "signature": {"shape": [3]}}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"kind": "module"}, "kind"),
        ({"kind": "pickle"}, "kind"),
        ({"metadata": {"bad": object()}}, "metadata"),
        ({"metadata": {"nan": float("nan")}}, "metadata"),
        ({"metadata": ["not", "a", "dict"]}, "metadata"),
        ({"content": "text, not bytes"}, "content"),
    ],
)
def test_bad_arguments(store: DirectoryStore, kwargs: dict, field: str) -> None:
    args = {"name": "f", "kind": "expression", "content": EXPR, "metadata": {}} | kwargs
    with pytest.raises(InvalidArgumentError) as ei:
        store.put(**args)
    assert ei.value.field == field
    assert len(store) == 0


# --- names ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "ok"),
    [
        ("f", True),
        ("_", True),
        ("F00_bar", True),
        ("my.func-v2", True),
        ("a..b", True),
        ("x" * 128, True),
        ("x" * 129, False),
        ("", False),
        (".", False),
        ("..", False),
        (".hidden", False),
        (".tmp-abc", False),
        ("1abc", False),
        ("-abc", False),
        ("a/b", False),
        ("../etc", False),
        ("a\\b", False),
        ("a b", False),
        ("a\x00b", False),
        ("naïve", False),
        ("f\n", False),
        (None, False),
        (7, False),
    ],
)
def test_name_validation(store: DirectoryStore, name: object, ok: bool) -> None:
    if ok:
        rec, _ = store.put(name, "expression", EXPR, {})  # type: ignore[arg-type]
        assert store.get(name).name == name  # type: ignore[arg-type]
        assert (store.root / "names" / f"{name}.json").exists()
    else:
        with pytest.raises(InvalidArgumentError) as ei:
            store.put(name, "expression", EXPR, {})  # type: ignore[arg-type]
        assert ei.value.field == "name"
        assert len(store) == 0


# --- persistence and crash recovery ---------------------------------------
def test_reopen_sees_everything(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with DirectoryStore(root) as s:
        recs = [
            s.put(f"f{i}", "export" if i % 2 else "expression", bytes([i]) * (i + 1), {"i": i})[0]
            for i in range(10)
        ]
        s.delete("f3")
    with DirectoryStore(root) as s:
        expected = [r for r in recs if r.name != "f3"]
        assert s.list() == sorted(expected, key=lambda r: r.name)
        assert len(s) == 9


def test_second_owner_is_refused(tmp_path: Path) -> None:
    s = DirectoryStore(tmp_path)
    with pytest.raises(StoreLockedError):
        DirectoryStore(tmp_path)
    s.close()
    DirectoryStore(tmp_path).close()  # free again after close


def test_crash_leftovers_are_skipped(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "s"
    with DirectoryStore(root) as s:
        s.put("good", "expression", EXPR, {"description": "fine"})
        s.put("corrupt_obj", "export", b"will be corrupted", {})
        s.put("missing_obj", "export", b"will vanish", {})
    names, objects = root / "names", root / "objects"
    # leftover temp files from a crash mid-write
    (names / ".tmp-abc123.tmp").write_bytes(b'{"name": "half')
    (objects / ".tmp-xyz789.tmp").write_bytes(b"half an obj")
    # record pointing at a missing object
    (objects / hexof(b"will vanish")).unlink()
    # object whose bytes no longer match its digest
    (objects / hexof(b"will be corrupted")).write_bytes(b"bit rot")
    # a truncated record and other junk
    (names / "truncated.json").write_text('{"name": "truncated", "kind": "expr')
    (names / "wrongname.json").write_text(
        json.dumps(
            {
                "name": "other",
                "kind": "expression",
                "digest": content_digest(EXPR),
                "metadata": {},
                "created": "2024-01-01T00:00:00Z",
            }
        )
    )
    (names / "list.json").write_text("[1, 2]")
    (names / "empty.json").write_bytes(b"")
    (names / "README").write_text("not a record")
    caplog.set_level(logging.WARNING, logger="dxserve.store")
    with DirectoryStore(root) as s:
        assert [r.name for r in s.list()] == ["good"]
        assert s.get("good").content == EXPR
        assert s.get("missing_obj") is None
        assert s.get("corrupt_obj") is None
        # the skipped names can be registered again, healing the store
        _, new = s.put("corrupt_obj", "export", b"will be corrupted", {})
        assert new
        s.put("missing_obj", "export", b"will vanish", {})
        s.put("truncated", "expression", EXPR2, {})
    assert "skipping" in caplog.text
    assert not (names / ".tmp-abc123.tmp").exists()  # owner cleaned up temp files
    assert not (objects / ".tmp-xyz789.tmp").exists()
    with DirectoryStore(root) as s:
        assert {r.name for r in s.list()} == {"good", "corrupt_obj", "missing_obj", "truncated"}
        assert s.get("corrupt_obj").content == b"will be corrupted"


def test_orphan_objects_collected_on_open(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with DirectoryStore(root) as s:
        s.put("f", "expression", EXPR, {})
    orphan = root / "objects" / hexof(b"unacknowledged put")
    orphan.write_bytes(b"unacknowledged put")
    with DirectoryStore(root) as s:
        assert len(s) == 1
    assert not orphan.exists()
    assert (root / "objects" / hexof(EXPR)).exists()


def test_orphans_kept_while_a_record_is_unreadable(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with DirectoryStore(root) as s:
        s.put("f", "expression", EXPR, {})
    (root / "names" / "f.json").write_text("{garbage")
    with DirectoryStore(root) as s:
        assert len(s) == 0
    assert (root / "objects" / hexof(EXPR)).exists()  # may still be recoverable


CHILD = textwrap.dedent(
    """
    import sys
    from dxserve.server.stores.directory import DirectoryStore

    s = DirectoryStore(sys.argv[1])
    print("ready", flush=True)
    for i in range(int(sys.argv[2])):
        content = (f"content-{i}-" * (1 + i % 7)).encode()
        s.put(f"fn_{i}", "export", content, {"i": i})
        print(f"acknowledged {i}", flush=True)
    print("done", flush=True)
    sys.stdin.read()  # wait to be killed
    """
)


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
@pytest.mark.parametrize("kill_after", [0, 7, 19])
def test_sigkill_loses_nothing_acknowledged(tmp_path: Path, kill_after: int) -> None:
    root = tmp_path / "s"
    n = 40
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), str(n)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    acknowledged: list[int] = []
    try:
        deadline = time.monotonic() + 60
        assert proc.stdout is not None
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("acknowledged"):
                acknowledged.append(int(line.split()[1]))
                if acknowledged[-1] >= kill_after:
                    os.kill(proc.pid, signal.SIGKILL)
                    break
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert acknowledged, "child never acknowledged a put"
    assert acknowledged == list(range(len(acknowledged)))
    # the lock died with the process; whatever was acknowledged is there, intact
    with DirectoryStore(root) as s:
        for i in acknowledged:
            rec = s.get(f"fn_{i}")
            assert rec is not None, f"acknowledged fn_{i} lost"
            assert rec.content == (f"content-{i}-" * (1 + i % 7)).encode()
            assert rec.metadata == {"i": i}
        # anything beyond is either complete or absent, never broken
        for r in s.list():
            assert r.digest == content_digest(r.content)
        assert not [p for p in (root / "names").iterdir() if p.name.startswith(".")]


# --- threads ----------------------------------------------------------------
def test_concurrent_puts(store: DirectoryStore) -> None:
    errors: list[BaseException] = []
    barrier = threading.Barrier(8)

    def worker(t: int) -> None:
        try:
            barrier.wait(timeout=10)
            for j in range(10):
                # half the threads share content so objects are shared too
                content = f"c-{t % 4}-{j}".encode()
                store.put(f"t{t}_f{j}", "expression", content, {"t": t})
                store.put("shared", "expression", b"same", {})  # idempotent race
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    assert not errors
    assert len(store) == 81
    store = reopen(store)
    assert len(store) == 81
    for t in range(8):
        for j in range(10):
            assert store.get(f"t{t}_f{j}").content == f"c-{t % 4}-{j}".encode()
    store.close()


# --- lazy content ---------------------------------------------------------------
def test_open_reads_no_content_and_get_checks_the_hash(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with DirectoryStore(root) as s:
        s.put("f", "export", b"payload", {"description": "d", "signature": {"x": 1}})
        s.put("g", "export", b"other payload", {})
    with DirectoryStore(root) as s:
        (rec,) = [r for r in s.records() if r.name == "f"]
        assert not hasattr(rec, "content") and rec.size == len(b"payload")
        assert rec.metadata == {"description": "d", "signature": {"x": 1}}
        assert s.used_bytes == len(b"payload") + len(b"other payload")
        # corrupted after open: found when read, dropped from the index, healed by a put
        (root / "objects" / hexof(b"other payload")).write_bytes(b"rot")
        assert s.get("g") is None
        assert s.record("g") is None and len(s) == 1
        assert s.used_bytes == len(b"payload")
        _, new = s.put("g", "export", b"other payload", {})
        assert new and s.get("g").content == b"other payload"
