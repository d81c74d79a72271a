"""The store stays bounded: a byte quota, lazily built functions in an LRU, and a
capped compilation cache."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import sqlite3
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

from dxclient.export import export_function
from dxcontract.errors import PayloadTooLargeError, StorageFullError, UnknownPreparationError
from dxserve.frameworks.jax.runtime import CachePruner, prune_cache_directory
from dxserve.server.registry import Registry
from dxserve.server.service import Service
from dxserve.server.stores.directory import DirectoryStore
from dxserve.settings import Settings
from tests.conftest import start_server, stop_server


def _objects_bytes(root: Path) -> int:
    """Bytes of the stored objects: the SQLite store's blobs (the default), or the files
    of a directory store."""
    if (root / "store.db").exists():
        with contextlib.closing(sqlite3.connect(root / "store.db")) as db:
            return db.execute("SELECT COALESCE(SUM(LENGTH(content)), 0) FROM objects").fetchone()[0]
    return sum(p.stat().st_size for p in (root / "objects").iterdir() if not p.name.startswith("."))


# --- the quota ------------------------------------------------------------------
def test_quota_counts_distinct_objects_and_frees_on_replace(tmp_path: Path) -> None:
    with DirectoryStore(tmp_path / "s", quota_bytes=1000) as s:
        s.put("a", "export", b"a" * 400, {})
        s.put("a_again", "export", b"a" * 400, {})  # the same object: counted once
        assert s.used_bytes == 400
        s.put("b", "export", b"b" * 500, {})
        assert s.used_bytes == 900
        with pytest.raises(StorageFullError) as info:
            s.put("c", "export", b"c" * 200, {})
        assert info.value.field == "body"
        with pytest.raises(PayloadTooLargeError):
            s.put("huge", "export", b"h" * 1001, {})
        # replacing b frees its bytes, so a larger replacement fits
        s.put("b", "export", b"B" * 600, {}, replace=True)
        assert s.used_bytes == 1000
        # a shared object is freed only when its last name goes
        s.delete("a")
        assert s.used_bytes == 1000
        s.delete("a_again")
        assert s.used_bytes == 600
        s.put("c", "export", b"c" * 400, {})
        assert s.used_bytes == _objects_bytes(s.root) == 1000
    with DirectoryStore(tmp_path / "s", quota_bytes=1000) as s:  # recounted at open
        assert s.used_bytes == 1000
        with pytest.raises(StorageFullError):
            s.put("d", "expression", b"d", {})


def test_quota_holds_under_16_concurrent_puts(tmp_path: Path) -> None:
    size, fit = 10_000, 5
    with DirectoryStore(tmp_path / "s", quota_bytes=size * fit) as s:
        barrier = threading.Barrier(16)

        def put(i: int) -> str:
            barrier.wait(timeout=10)
            try:
                s.put(f"f{i}", "export", bytes([i]) * size, {})
                return "ok"
            except StorageFullError:
                return "full"

        with ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(put, range(16)))
        assert outcomes.count("ok") == fit and outcomes.count("full") == 16 - fit
        assert s.used_bytes == _objects_bytes(s.root) == size * fit
        assert len(s) == fit


def test_quota_over_http_16_concurrent_registrations(make_server) -> None:
    content_size = len(b'{"args": ["x"], "expression": "jnp.sum(x) * 1000"}')
    fit = 6
    srv = make_server(env={"DXSERVE_STORE_QUOTA_BYTES": str(content_size * fit)})

    def register(i: int) -> httpx.Response:
        body = {"name": f"e{i}", "expression": f"jnp.sum(x) * {1000 + i}"}
        return httpx.post(srv.url + "/functions", json=body)

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(register, range(16)))
    codes = sorted(r.status_code for r in answers)
    assert codes.count(201) == fit and codes.count(507) == 16 - fit, codes
    full = next(r for r in answers if r.status_code == 507)
    assert full.headers["content-type"].startswith("application/problem+json")
    assert full.json()["type"].endswith("insufficient-storage")
    assert _objects_bytes(srv.store) <= content_size * fit
    # one registration larger than the whole quota: 413
    big = {"name": "big", "expression": "jnp.sum(x) + " + " + ".join(["x[0]"] * 80)}
    assert httpx.post(srv.url + "/functions", json=big).status_code == 413
    # deleting one frees room again
    created = next(r.json()["name"] for r in answers if r.status_code == 201)
    assert httpx.delete(f"{srv.url}/functions/{created}").status_code in (200, 204)
    body = {"name": "later", "expression": "jnp.sum(x) * 1234"}
    again = httpx.post(srv.url + "/functions", json=body)
    assert again.status_code == 201, again.text


# --- lazy building and the LRU of built functions -------------------------------
def test_registry_builds_lazily_and_evicts(tmp_path: Path) -> None:
    root = tmp_path / "s"
    with DirectoryStore(root) as s:
        reg = Registry(s, max_loaded=2)
        for i in range(5):
            reg.register(f"p{i}", "expression", b'{"args": ["x"], "expression": "jnp.sum(x ** %d)"}'
                         % (i + 2))
        assert reg.loaded_count() == 2
    with DirectoryStore(root) as s:
        reg = Registry(s, max_loaded=2)
        evicted: list[str] = []
        reg.on_evict.append(lambda e: evicted.append(e.name))
        assert reg.load_store() == 5
        assert reg.loaded_count() == 0  # nothing built at start
        described = reg.lookup("p3").describe()  # described without building
        assert described["signature"] == {"args": ["x"], "expression": "jnp.sum(x ** 5)"}
        assert reg.loaded_count() == 0
        x = np.array([0.5, 1.5])
        import dxserve

        for _ in range(3):
            for i in range(5):
                g = dxserve.gradient(reg.get(f"p{i}").fn, "jax-reverse", x)
                np.testing.assert_allclose(g, (i + 2) * x ** (i + 1), rtol=1e-12)
                assert reg.loaded_count() <= 2
        assert len(evicted) == 13  # 15 builds, 2 still loaded


def test_evicted_function_drops_its_preps_and_handles(tmp_path: Path) -> None:
    settings = Settings(store=tmp_path / "s", functions=[], max_loaded_functions=2)
    service = Service(settings)
    try:
        async def scenario() -> None:
            for i in range(4):
                await service.register({"name": f"q{i}", "expression": f"jnp.sum(x ** 2) * {i + 1}"})
            x = np.array([1.0, 2.0])
            made = await service.prepare("gradient", "q0", "jax-reverse", x)
            out = await service.call("gradient", "q0", "jax-reverse", x, prep=made["prep"])
            np.testing.assert_allclose(out["gradient"], 2 * x)
            for _ in range(2):  # round robin over 4 with room for 2: every call rebuilds
                for i in range(4):
                    out = await service.call("gradient", f"q{i}", "jax-reverse", x)
                    np.testing.assert_allclose(out["gradient"], 2 * x * (i + 1), rtol=1e-12)
            assert service.registry.loaded_count() == 2
            with pytest.raises(UnknownPreparationError):  # a clean 404, not a 500
                await service.call("gradient", "q0", "jax-reverse", x, prep=made["prep"])
            live = {id(p.function) for p in service.cache._items._items.values()}
            assert len(live) <= 2

        asyncio.run(scenario())
    finally:
        service.close()


# --- a restarted server on a store larger than its memory budget -----------------
CONSTANT = 200_000  # float64 numbers baked into each export (1.6 MB, in each map)
EXPORTS = 8


def _weights(i: int) -> np.ndarray:
    return np.random.default_rng(i).random(CONSTANT)


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc")
def test_restart_on_a_large_store_starts_small_and_serves_on_demand(tmp_path: Path) -> None:
    env = {"DXSERVE_MAX_LOADED_FUNCTIONS": "2"}
    bundles = []
    for i in range(EXPORTS):
        w = _weights(i)  # numpy: a float64 constant, as x64 is on while exporting

        def f(x, w=w):
            return jnp.sum(x**2) * jnp.sum(jnp.asarray(w))

        bundles.append(export_function(f, np.ones(3)))
    stored = sum(len(b) for b in bundles)
    first = start_server(tmp_path / "big", env=env, modules=("dxserve.examples",))
    try:
        for i, bundle in enumerate(bundles):
            body = {"name": f"big{i}", "export": base64.b64encode(bundle).decode()}
            r = httpx.post(first.url + "/functions", json=body, timeout=300)
            assert r.status_code == 201, r.text
    finally:
        stop_server(first)

    empty = start_server(tmp_path / "empty", env=env, modules=("dxserve.examples",))
    restarted = start_server(tmp_path / "big", env=env, modules=("dxserve.examples",))
    try:
        time.sleep(1.0)
        rss_empty, rss_started = _rss_kib(empty.proc.pid), _rss_kib(restarted.proc.pid)
        listed = httpx.get(restarted.url + "/functions").json()
        names = {f["name"] for f in (listed["functions"] if isinstance(listed, dict) else listed)}
        assert {f"big{i}" for i in range(EXPORTS)} <= names
        x = np.array([0.5, -1.0, 2.0])
        for _ in range(2):
            for i in range(EXPORTS):
                body = {"function": f"big{i}", "backend": "jax-reverse", "x": x.tolist()}
                r = httpx.post(restarted.url + "/gradient", json=body)
                assert r.status_code == 200, r.text
                want = 2 * x * np.sum(_weights(i))
                np.testing.assert_allclose(r.json()["gradient"], want, rtol=1e-10)
        rss_served = _rss_kib(restarted.proc.pid)
    finally:
        stop_server(restarted)
        stop_server(empty)
    print(
        f"\nstore: {EXPORTS} exports, {stored / 2**20:.1f} MiB; RSS after start: empty store "
        f"{rss_empty / 1024:.0f} MiB, full store {rss_started / 1024:.0f} MiB; after serving "
        f"every export twice with 2 loaded at most: {rss_served / 1024:.0f} MiB"
    )
    # Nothing is built at start: the full store costs about what an empty one does.
    assert rss_started - rss_empty < max(stored // 1024 // 2, 30 * 1024)


# --- the compilation cache cap ------------------------------------------------------
def test_compilation_cache_is_pruned_to_its_cap(tmp_path: Path) -> None:
    cache = tmp_path / "jax-cache"
    (cache / "executables").mkdir(parents=True)
    (cache / "executables" / "kept.dxexe").write_bytes(b"e" * 5000)  # bounded on its own
    now = time.time()
    for i in range(20):
        p = cache / f"jit_f{i}-cache"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (now - 1000 + i, now - 1000 + i))  # f0 is the least recently used
    left = prune_cache_directory(cache, 7_500)
    assert left <= 7_500
    remaining = sorted(p.name for p in cache.iterdir() if p.is_file())
    assert remaining == sorted(f"jit_f{i}-cache" for i in range(13, 20))
    assert (cache / "executables" / "kept.dxexe").exists()

    # later writes are pruned by the periodic pass
    pruner = CachePruner(cache, 7_500, interval=0.05)
    pruner.start()
    try:
        for i in range(20, 30):
            (cache / f"jit_f{i}-cache").write_bytes(b"y" * 1000)
        deadline = time.monotonic() + 60  # an event, bounded: a loaded machine is slow
        while time.monotonic() < deadline:
            if _stored_bytes(cache) <= 7_500:
                break
            time.sleep(0.05)
        pruner.stop()
        assert _stored_bytes(cache) <= 7_500
    finally:
        pruner.stop()


def _stored_bytes(directory: Path) -> int:
    """Bytes of the files directly in ``directory``; one the pruner removes while they
    are listed counts nothing."""
    total = 0
    for path in directory.iterdir():
        try:
            if path.is_file():
                total += path.stat().st_size
        except FileNotFoundError:
            pass
    return total


def test_server_prunes_compilation_cache_at_start(make_server, tmp_path: Path) -> None:
    cache = tmp_path / "jax-cache"
    cache.mkdir()
    for i in range(30):
        (cache / f"jit_old{i}-cache").write_bytes(b"z" * (100 << 10))  # 3 MiB in all
    srv = make_server(
        env={"DXSERVE_COMPILATION_CACHE_MB": "1", "DXSERVE_WARM_UP": "false"},
        args=("--compilation-cache", str(cache)),
    )
    assert httpx.get(srv.url + "/health").status_code == 200
    total = sum(p.stat().st_size for p in cache.iterdir() if p.is_file())
    assert total <= 1 << 20

