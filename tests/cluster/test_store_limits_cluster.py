"""The function limit and the quota across server processes on one store
(``make test-cluster``): real ``dxserve serve`` processes, many registrations at once
from several threads over fresh connections.

* ``--workers 2`` (two processes behind one port, one SQLite store);
* two servers on one SQLite store;
* two servers on one PostgreSQL database (a real PostgreSQL, ``tests/postgres_server.py``).

Each stores exactly the limit and refuses every other registration: 429 naming
``DXSERVE_MAX_FUNCTIONS``, or 507 naming ``DXSERVE_STORE_QUOTA_BYTES``. The store decides
both inside its serialized write transaction (``store.admit_put``), so no process's own
count can let one more through.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.cluster.test_shared_store import _wait_workers, postgres  # noqa: F401 - a fixture
from tests.conftest import ServerProcess, start_server, stop_server

pytestmark = pytest.mark.cluster

CAP = 20
TRIES = 60
ENV = {"DXSERVE_WARM_UP": "false", "DXSERVE_STORE_SYNC_INTERVAL": "0.25"}
# every expression below is this long: "jnp.sum(x) * 1<3 digits>"
CONTENT = len(b'{"args": ["x"], "expression": "jnp.sum(x) * 1000"}')


@pytest.fixture
def servers(tmp_path: Path):
    started: list[ServerProcess] = []

    def start(store: str, env: dict[str, str], *args: str) -> ServerProcess:
        srv = start_server(tmp_path / f"s{len(started)}", env={**ENV, **env},
                           args=["--store", store, *args], modules=("dxserve.examples",))
        started.append(srv)
        return srv

    yield start
    for srv in started:
        stop_server(srv)


def register_many(urls: list[str]) -> list[httpx.Response]:
    """``TRIES`` registrations of distinct new names from 8 threads, all released at
    once, spread over ``urls``, each on a fresh connection (so ``--workers`` spreads
    them over its processes)."""
    barrier = threading.Barrier(8)

    def one(i: int) -> httpx.Response:
        if i < 8:
            barrier.wait(timeout=60)
        body = {"name": f"f{i}", "expression": f"jnp.sum(x) * {1000 + i}"}
        return httpx.post(f"{urls[i % len(urls)]}/functions", json=body)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(TRIES)))


def sqlite_count(store: str) -> Callable[[], tuple[int, int]]:
    def count() -> tuple[int, int]:
        with contextlib.closing(sqlite3.connect(Path(store) / "store.db")) as db:
            return (db.execute("SELECT COUNT(*) FROM functions").fetchone()[0],
                    db.execute("SELECT COALESCE(SUM(size), 0) FROM objects").fetchone()[0])
    return count


def postgres_count(url: str) -> Callable[[], tuple[int, int]]:
    def count() -> tuple[int, int]:
        import psycopg

        with psycopg.connect(url) as db:
            return (db.execute("SELECT COUNT(*) FROM functions").fetchone()[0],
                    int(db.execute("SELECT COALESCE(SUM(size), 0) FROM objects").fetchone()[0]))
    return count


def check(answers: list[httpx.Response], fit: int, refused: int, setting: str,
          count: Callable[[], tuple[int, int]]) -> list[str]:
    """Assert exactly ``fit`` were stored and the rest refused; the stored names."""
    codes = [r.status_code for r in answers]
    assert codes.count(201) == fit and codes.count(refused) == TRIES - fit, sorted(codes)
    problem = next(r for r in answers if r.status_code == refused)
    assert problem.headers["content-type"].startswith("application/problem+json")
    assert setting in problem.json()["detail"], problem.json()
    assert count() == (fit, fit * CONTENT)
    # exactly the acknowledged ones are stored, and served
    acked = sorted(f"f{i}" for i, r in enumerate(answers) if r.status_code == 201)
    url = str(answers[0].request.url).rsplit("/functions", 1)[0]
    listed = httpx.get(f"{url}/functions").json()["functions"]
    assert sorted(f["name"] for f in listed if f["kind"] == "expression") == acked
    return acked


LIMITS = {
    "cap": ({"DXSERVE_MAX_FUNCTIONS": str(CAP)}, CAP, 429, "DXSERVE_MAX_FUNCTIONS"),
    "quota": ({"DXSERVE_STORE_QUOTA_BYTES": str(CAP * CONTENT)}, CAP, 507,
              "DXSERVE_STORE_QUOTA_BYTES"),
}


@pytest.mark.parametrize("limit", LIMITS)
def test_workers_keep_one_limit(servers, tmp_path: Path, limit: str) -> None:
    env, fit, refused, setting = LIMITS[limit]
    store = str(tmp_path / "store")
    srv = servers(store, env, "--workers", "2")
    _wait_workers(srv, 2)
    check(register_many([srv.url]), fit, refused, setting, sqlite_count(store))


@pytest.mark.parametrize("limit", LIMITS)
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_two_servers_keep_one_limit(servers, request, tmp_path: Path, limit: str,
                                    backend: str) -> None:
    env, fit, refused, setting = LIMITS[limit]
    if backend == "sqlite":
        store = str(tmp_path / "store")
        count = sqlite_count(store)
    else:
        store = request.getfixturevalue("postgres").database("t" + uuid.uuid4().hex[:12])
        count = postgres_count(store)
    a, b = servers(store, env), servers(store, env)
    acked = check(register_many([a.url, b.url]), fit, refused, setting, count)
    # a deletion through one frees a slot for the other
    assert httpx.delete(f"{a.url}/functions/{acked[0]}").status_code == 200
    body = {"name": "later", "expression": "jnp.sum(x) * 1999"}
    assert httpx.post(f"{b.url}/functions", json=body).status_code == 201
    assert count() == (fit, fit * CONTENT)
