"""A detached job survives SIGKILL of its server: restarted on the same store, the server
resumes it from its last checkpoint, recomputes none of the chunks kept before the
kill, and its result is the uninterrupted call's bit for bit. On the SQLite store the
restarted process takes the job over once the dead one's lease has expired; on a
directory store (one process's) at once. A server stopped with SIGTERM hands its job
back as it stops: the restarted one takes it at once, its lease notwithstanding (ten
minutes here). ``slow``: two server starts per case.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx
import numpy as np
import pytest

from dxcontract import codec
from tests.conftest import start_server, stop_server
from tests.http.test_jobs_http import HEAVY, HEAVY_N, follow, status, submit
from tests.slow_functions import heavy_sines_hessian

pytestmark = pytest.mark.slow

CHUNK = HEAVY["backend"]["batch_size"]
CHUNKS = HEAVY_N // CHUNK
ENV = {"DXSERVE_WARM_UP": "false", "DXSERVE_JOB_POLL_INTERVAL": "0.2"}
MODULES = ("dxserve.examples", "tests.slow_functions")


@pytest.mark.parametrize(
    ("store", "stop", "lease"),
    [("sqlite", signal.SIGKILL, 2), ("directory", signal.SIGKILL, 2),
     ("sqlite", signal.SIGTERM, 600)],
    ids=["sqlite-kill", "directory-kill", "sqlite-term"],
)
def test_a_stopped_servers_job_resumes_from_its_checkpoints_with_the_same_bits(
    tmp_path: Path, store: str, stop: int, lease: int
) -> None:
    args = ["--store", f"dir://{tmp_path / 'dir-store'}"] if store == "directory" else []
    env = {**ENV, "DXSERVE_JOB_LEASE_SECONDS": str(lease)}
    srv = start_server(tmp_path / "server", env=env, args=args, modules=MODULES)
    try:
        job = submit(srv.url, "hessian", HEAVY, token=None)
        # wait for the third chunk's progress (each is reported once it is kept), then kill
        seen = follow(srv.url, job["id"], token=None, stop=lambda e, d: e == "progress"
                      and json.loads(d)["done"] >= 3 * CHUNK)
        kept = json.loads(seen[-1][1])["done"] // CHUNK
        os.kill(srv.proc.pid, stop)
        srv.proc.wait(timeout=60)
    finally:
        stop_server(srv)
    assert 3 <= kept < CHUNKS
    srv = start_server(tmp_path / "server", env=env, args=args, modules=MODULES)
    try:
        found = follow(srv.url, job["id"], token=None, accept="text/event-stream; arrays=b64")
        assert found[-1][0] == "result", found[-3:]
        done = status(srv.url, job["id"], token=None)
        assert done["status"] == "succeeded" and done["attempts"] == 2
        # the chunks kept before the kill were taken back, and every chunk was computed
        # exactly once over both runs: none was recomputed
        assert done["chunks"]["restored"] >= kept
        assert done["chunks"]["computed"] == CHUNKS
        plain = httpx.post(f"{srv.url}/hessian", json=HEAVY,
                           headers={"accept": "application/json; arrays=b64"}, timeout=300)
        assert json.loads(found[-1][1]) == plain.json()  # typed base64: the same bits
        fetched = httpx.get(f"{srv.url}/jobs/{job['id']}/result",
                            headers={"accept": codec.BINARY_TYPE})
        again = httpx.post(f"{srv.url}/hessian", json=HEAVY,
                           headers={"accept": codec.BINARY_TYPE}, timeout=300)
        assert fetched.content == again.content
        H = codec.decode_result(plain.json()["hessian"], "hessian")
        np.testing.assert_allclose(H, heavy_sines_hessian(np.asarray(HEAVY["x"])), rtol=1e-9,
                                   atol=1e-9)
    finally:
        stop_server(srv)
