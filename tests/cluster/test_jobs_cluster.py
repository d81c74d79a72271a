"""Detached jobs with several server processes on one store (``make test-cluster``): real
``dxserve serve`` processes on the embedded SQLite store and on a real PostgreSQL
(``tests/postgres_server.py``).

* jobs submitted to either process race for both runners: each runs exactly once (one
  attempt, every chunk computed once), and either process answers its status, events
  and result;
* the process running a job is SIGKILLed mid-job: the other takes the job over once
  the lease has expired, resumes it from its checkpoints, and its result is the plain
  call's bit for bit;
* ``--workers 2``: two processes behind one port run the jobs sent to it, once each.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path

import httpx
import numpy as np
import pytest

from dxcontract import codec
from tests.conftest import ServerProcess, start_server, stop_server
from tests.http.test_jobs_http import HEAVY, HEAVY_N, follow, status, submit
from tests.postgres_server import find_bin_dir, running_postgres
from tests.references import rosenbrock_hessian

pytestmark = pytest.mark.cluster

LEASE = 2.0  # DXSERVE_JOB_LEASE_SECONDS here: a dead runner's job is free after it
ENV = {"DXSERVE_WARM_UP": "false", "DXSERVE_JOB_LEASE_SECONDS": str(LEASE),
       "DXSERVE_JOB_POLL_INTERVAL": "0.1", "DXSERVE_JOB_RUNNERS": "2"}
CHUNK = HEAVY["backend"]["batch_size"]


@pytest.fixture(scope="module")
def postgres():
    if find_bin_dir() is None:
        if os.environ.get("DXSERVE_REQUIRE_POSTGRES"):
            pytest.fail("PostgreSQL binaries not found (apt-get install postgresql)")
        pytest.skip("PostgreSQL binaries not found (apt-get install postgresql)")
    pytest.importorskip("psycopg", reason="the postgres extra: pip install -e '.[postgres]'")
    with running_postgres() as pg:
        yield pg


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "shared-store")
    return request.getfixturevalue("postgres").database("j" + uuid.uuid4().hex[:12])


@pytest.fixture
def two(store: str, tmp_path: Path):
    """Two server processes on ``store``."""
    started = [
        start_server(tmp_path / f"p{i}", env=ENV, args=["--store", store],
                     modules=("dxserve.examples", "tests.slow_functions"))
        for i in range(2)
    ]
    yield started
    for srv in started:
        stop_server(srv)


def test_jobs_on_two_processes_each_run_once_and_either_answers(two) -> None:
    a, b = two
    x = np.linspace(0.1, 1.3, 1200)
    body = {"function": "rosenbrock", "backend": "jax-forward", "x": x.tolist()}
    jobs = [submit((a, b)[i % 2].url, "hessian", body, token=None)["id"] for i in range(6)]
    for i, job_id in enumerate(jobs):  # followed through the other process
        assert follow((b, a)[i % 2].url, job_id, token=None)[-1][0] == "result"
    plain = httpx.post(f"{a.url}/hessian", json=body, headers={"accept": codec.BINARY_TYPE})
    for job_id in jobs:
        for srv in (a, b):
            done = status(srv.url, job_id, token=None)
            assert done["status"] == "succeeded" and done["attempts"] == 1, done
            assert done["chunks"] == {"computed": 10, "restored": 0}, done
        fetched = httpx.get(f"{b.url}/jobs/{job_id}/result",
                            headers={"accept": codec.BINARY_TYPE})
        assert fetched.content == plain.content
    H = codec.decode_response(plain.content, plain.headers["content-type"],
                              plain.headers[codec.HEADER_LENGTH], arrays=("hessian",))["hessian"]
    np.testing.assert_allclose(np.asarray(H), rosenbrock_hessian(x), rtol=1e-10, atol=1e-9)


def _running_on(servers: list[ServerProcess], job: dict) -> ServerProcess:
    pid = int(job["runner"].split(":")[1])
    (runner,) = [srv for srv in servers if srv.proc.pid == pid]
    return runner


def test_a_killed_runners_job_is_taken_over_after_its_lease(two) -> None:
    a, b = two
    job = submit(a.url, "hessian", HEAVY, token=None)
    seen = follow(b.url, job["id"], token=None,
                  stop=lambda e, d: e == "progress" and json.loads(d)["done"] >= 3 * CHUNK)
    kept = json.loads(seen[-1][1])["done"] // CHUNK
    running = status(b.url, job["id"], token=None)
    victim = _running_on(two, running)
    survivor = b if victim is a else a
    os.kill(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(timeout=30)
    found = follow(survivor.url, job["id"], token=None, accept="text/event-stream; arrays=b64")
    assert found[-1][0] == "result", found[-3:]
    done = status(survivor.url, job["id"], token=None)
    assert done["status"] == "succeeded" and done["attempts"] == 2, done
    assert done["chunks"]["restored"] >= kept and done["chunks"]["computed"] == HEAVY_N // CHUNK
    plain = httpx.post(f"{survivor.url}/hessian", json=HEAVY,
                       headers={"accept": "application/json; arrays=b64"}, timeout=300)
    assert json.loads(found[-1][1]) == plain.json()


def test_workers_behind_one_port_run_each_job_once(tmp_path: Path) -> None:
    srv = start_server(tmp_path / "w", env=ENV, args=["--workers", "2"],
                       modules=("dxserve.examples",))
    try:
        x = np.linspace(0.1, 1.3, 1100)
        body = {"function": "rosenbrock", "backend": "jax-forward", "x": x.tolist()}
        jobs = [submit(srv.url, "hessian", body, token=None)["id"] for _ in range(4)]
        for job_id in jobs:  # each request may reach either process
            assert follow(srv.url, job_id, token=None)[-1][0] == "result"
            done = status(srv.url, job_id, token=None)
            assert done["attempts"] == 1 and done["chunks"]["computed"] == 10, done
        fetched = httpx.get(f"{srv.url}/jobs/{jobs[-1]}/result",
                            headers={"accept": "application/json; arrays=b64"})
        H = codec.decode_result(fetched.json()["hessian"], "hessian")
        np.testing.assert_allclose(H, rosenbrock_hessian(x), rtol=1e-10, atol=1e-9)
    finally:
        stop_server(srv)
