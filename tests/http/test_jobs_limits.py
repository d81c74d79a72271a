"""Detached jobs inside their limits, decided at submission, over real HTTP.

Real ``dxserve serve`` processes on free ports. A job reserves its expected result (its
operator's output shapes times dtypes) when it is submitted: a result past the job
store's bytes, or past the largest value the store keeps, is a 507 before anything
runs, and the jobs' stored bytes stay under the limit however many are submitted. A
submission's body counts against the in-flight budget while it is stored. Without
tokens configured, every bearer token is the anonymous owner (one quota, not one per
invented string). Owners take turns: one owner's queue does not hold back another's
job. A job computes the function version it was submitted with, even when the name is
replaced while it waits. A directory store's half-written files are gone after a
restart. Tests wait on job events and server state, never on the clock; the largest
server here compiles a 11,584-column Jacobian and allocates nothing of its result
(peak RSS about 0.35 GB).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from dxcontract import codec
from tests.conftest import ServerProcess, start_server, stop_server
from tests.health_probe import HealthProbe
from tests.http.test_jobs_http import follow, is_problem, status, submit

#: a Hessian of 20 chunks taking seconds: it keeps the one runner busy while a test
#: queues jobs behind it, and is cancelled when the test lets the queue move
BUSY = {
    "function": "heavy_sines",
    "backend": {"type": "jax-forward", "batch_size": 100},
    "x": np.linspace(0.1, 1.3, 2000).tolist(),
}
ATTACKER, VICTIM = "attacker-token-0123456789", "victim-token-0123456789"
MODULES = ("dxserve.examples", "tests.slow_functions")


def server(tmp_path: Path, name: str, tokens: tuple[str, ...] = (), **env: str) -> ServerProcess:
    settings = {
        "DXSERVE_WARM_UP": "false",
        "DXSERVE_JOB_RUNNERS": "1",
        "DXSERVE_JOB_POLL_INTERVAL": "0.2",
        **env,
    }
    if tokens:
        path = tmp_path / f"{name}-tokens"
        path.write_text("\n".join(tokens) + "\n")
        settings["DXSERVE_TOKENS_FILE"] = str(path)
    srv = start_server(tmp_path / name, env=settings, modules=MODULES)
    PROBES[srv.url] = HealthProbe(srv.url)
    return srv


#: the /health probes (1 s timeout) of the servers ``server`` started, by URL
PROBES: dict[str, HealthProbe] = {}
ENDED: list[HealthProbe] = []


def stop(srv: ServerProcess) -> None:
    """Stop ``srv``'s /health probe, then ``srv``."""
    probe = PROBES.pop(srv.url, None)
    if probe is not None:
        probe.stop()
        ENDED.append(probe)
    stop_server(srv)


@pytest.fixture(autouse=True)
def health_answers_throughout() -> Iterator[None]:
    """Every server a test starts with ``server`` is probed on /health with a 1 s timeout
    from its start to its stop: one unanswered probe fails the test."""
    yield
    ended, ENDED[:] = list(ENDED), []
    for probe in ended:
        probe.check()


def busy_runner(url: str, token: str | None) -> dict:
    """A running job that holds the one runner until it is cancelled."""
    job = submit(url, "hessian", BUSY, token=token)
    follow(url, job["id"], token=token, stop=lambda name, _: name == "progress")
    assert status(url, job["id"], token)["status"] == "running"
    return job


def peak_rss(pid: int) -> int:
    """The most resident memory process ``pid`` has had, in bytes (Linux)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def listed(url: str, token: str | None) -> list[dict]:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    found, after = [], None
    while True:
        params = {"limit": 100, **({"after": after} if after else {})}
        page = httpx.get(f"{url}/jobs", params=params, headers=headers).json()
        found += page["jobs"]
        after = page["next"]
        if after is None:
            return found


# --- expected results reserved at submission -----------------------------------------------
def test_a_result_past_the_stores_largest_value_is_refused_at_submission(tmp_path: Path) -> None:
    """A 23 KB body whose Jacobian takes 1.07 GB: past SQLite's largest value (10^9
    bytes) while under the default 1 GiB job store. Refused when submitted, with
    nothing stored or run, rather than failing its final write as a 500."""
    srv = server(tmp_path, "blob")
    try:
        n = 11_584
        body = {"function": "sin_cumsum", "x": np.linspace(0.1, 1.3, n).round(6).tolist()}
        r = httpx.post(f"{srv.url}/jobs/jacobian", json=body, timeout=300)
        doc = is_problem(r, 507, "insufficient-storage")
        assert doc["limit"] == "store_blob_bytes" and doc["needed"] >= n * n * 8
        assert doc["maximum"] < 10**9 and "directory store" in doc["detail"]
        assert listed(srv.url, None) == []
        assert httpx.get(f"{srv.url}/health").status_code == 200
        # nothing of the result was ever allocated (it would take 1.07 GB)
        assert srv.proc.poll() is None and peak_rss(srv.proc.pid) < 800 * 2**20
    finally:
        stop(srv)


def test_a_result_past_the_per_call_limits_is_refused_at_submission(tmp_path: Path) -> None:
    """A job whose Jacobian has more numbers than ``DXSERVE_MAX_RESULT_ELEMENTS`` (here
    20,000^2 = 4e8, a 3.2 GB result) is the plain call's 422 when it is submitted, not a
    job accepted and stored as failed once it runs."""
    srv = server(tmp_path, "elements")
    try:
        body = {"function": "sin_cumsum", "x": [0.5] * 20_000}
        r = httpx.post(f"{srv.url}/jobs/jacobian", json=body, timeout=300)
        plain = httpx.post(f"{srv.url}/jacobian", json=body, timeout=300)
        assert plain.status_code == 422, plain.text
        doc = is_problem(r, 422, "result-too-large")
        assert doc["type"] == plain.json()["type"] and doc["detail"] == plain.json()["detail"]
        assert listed(srv.url, None) == []
        assert srv.proc.poll() is None
    finally:
        stop(srv)


def test_the_jobs_stored_bytes_stay_under_the_limit(tmp_path: Path) -> None:
    """48 Hessian jobs of small bodies under a 1 MiB job store: the results they would
    store are counted when each is submitted, so the store never holds past 1 MiB; a
    result alone past the limit is refused before it runs, naming the setting."""
    limit = 1 << 20
    srv = server(
        tmp_path, "bytes", DXSERVE_JOB_STORE_BYTES=str(limit), DXSERVE_MAX_JOBS_PER_TOKEN="64"
    )
    try:
        url = srv.url
        # sin_cumsum's 400 x 400 Jacobian: 1.28 MB, past the limit alone
        r = httpx.post(
            f"{url}/jobs/jacobian",
            json={"function": "sin_cumsum", "x": np.linspace(0.1, 1.3, 400).tolist()},
        )
        doc = is_problem(r, 507, "insufficient-storage")
        assert doc["limit"] == "job_store_bytes" and "DXSERVE_JOB_STORE_BYTES" in doc["detail"]
        assert listed(url, None) == []
        small = {
            "function": "rosenbrock",
            "backend": "jax-forward",
            "x": np.linspace(0.1, 1.3, 120).tolist(),
        }  # 115,200 bytes of Hessian
        accepted, refused = [], 0
        for _ in range(48):
            r = httpx.post(f"{url}/jobs/hessian", json=small)
            if r.status_code == 202:
                accepted.append(r.json()["id"])
            else:
                assert is_problem(r, 507)["limit"] == "job_store_bytes"
                refused += 1
        assert accepted and refused
        for job_id in accepted:
            assert follow(url, job_id, token=None)[-1][0] == "result"
        jobs = listed(url, None)
        assert len(jobs) == len(accepted) and all(j["status"] == "succeeded" for j in jobs)
        assert sum(j["result_bytes"] for j in jobs) <= limit
        metrics = httpx.get(f"{url}/metrics").text
        assert "dxserve_jobs" in metrics
    finally:
        stop(srv)


# --- the in-flight budget ----------------------------------------------------------------
def _inflight(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return float(re.search(r"^dxserve_inflight_bytes ([0-9.e+]+)$", text, re.M).group(1))


def test_a_job_body_counts_against_the_inflight_budget_while_it_is_stored(
    tmp_path: Path,
) -> None:
    """A submission holds its body and the store's copy of it: with 2.5 MB of another
    request's body held and a 4 MB budget, a 1 MB binary job body (2 MB while stored) is
    a 503, and nothing is stored; once the other request has gone it is accepted."""
    srv = server(tmp_path, "inflight", DXSERVE_MAX_INFLIGHT_BYTES="4000000")
    try:
        url = srv.url
        x = np.linspace(0.1, 1.3, 131_072)  # 1 MiB of float64
        body, media, headers = codec.encode_body({"function": "rosenbrock", "x": x}, "binary")
        held = socket.create_connection(("127.0.0.1", srv.port))
        try:
            held.sendall(
                f"POST /gradient HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: {media}\r\n"
                f"content-length: 2500000\r\n\r\n".encode()
                + b"\0" * 1000
            )
            for _ in range(200):  # until the server has admitted it (a probe, not a clock)
                if _inflight(url) >= 2_500_000:
                    break
                held.settimeout(0.05)
                try:
                    held.recv(1)
                except TimeoutError:
                    pass
            assert _inflight(url) >= 2_500_000
            assert httpx.get(f"{url}/health").status_code == 200
            r = httpx.post(
                f"{url}/jobs/gradient",
                content=body,
                headers={"content-type": media, **headers},
            )
            doc = is_problem(r, 503, "overloaded")
            assert "DXSERVE_MAX_INFLIGHT_BYTES" in doc["detail"] and r.headers["retry-after"]
            assert listed(url, None) == []
        finally:
            held.close()
        for _ in range(200):
            if _inflight(url) == 0:
                break
            httpx.get(f"{url}/health")
        r = httpx.post(
            f"{url}/jobs/gradient",
            content=body,
            headers={"content-type": media, **headers},
        )
        assert r.status_code == 202, r.text
        job = r.json()
        assert follow(url, job["id"], token=None)[-1][0] == "result"
    finally:
        stop(srv)


# --- owners ------------------------------------------------------------------------------
def test_without_tokens_every_bearer_token_is_the_anonymous_owner(tmp_path: Path) -> None:
    """Invented tokens do not each open a quota of jobs: they are one owner, the
    anonymous one, who sees them all."""
    srv = server(tmp_path, "anon", DXSERVE_MAX_JOBS_PER_TOKEN="2")
    try:
        url = srv.url
        first = busy_runner(url, "invented-1")
        small = {"function": "rosenbrock", "x": [1.0, 2.0, 3.0]}
        second = submit(url, "gradient", small, token="invented-2")
        r = httpx.post(
            f"{url}/jobs/gradient",
            json=small,
            headers={"authorization": "Bearer invented-3"},
        )
        assert is_problem(r, 429, "too-many-jobs")["limit"] == "max_jobs_per_token"
        assert {j["id"] for j in listed(url, None)} == {first["id"], second["id"]}
        assert status(url, first["id"], token="invented-4")["status"] == "running"
        assert httpx.delete(f"{url}/jobs/{first['id']}").status_code == 202
        assert follow(url, second["id"], token=None)[-1][0] == "result"
    finally:
        stop(srv)


def test_owners_take_turns_so_a_long_queue_does_not_hold_back_another_owners_job(
    tmp_path: Path,
) -> None:
    """30 jobs of one owner wait behind a running one; another owner's job, submitted
    last, runs next, before any of the 30."""
    srv = server(tmp_path, "turns", (ATTACKER, VICTIM), DXSERVE_MAX_JOBS_PER_TOKEN="40")
    try:
        url = srv.url
        running = busy_runner(url, ATTACKER)
        small = {"function": "rosenbrock", "x": [1.0, 2.0, 3.0]}
        queue = [submit(url, "gradient", small, token=ATTACKER)["id"] for _ in range(30)]
        victim = submit(url, "gradient", small, token=VICTIM)["id"]
        assert status(url, running["id"], ATTACKER)["status"] == "running"  # all queued
        assert (
            httpx.delete(
                f"{url}/jobs/{running['id']}",
                headers={"authorization": f"Bearer {ATTACKER}"},
            ).status_code
            == 202
        )
        assert follow(url, victim, token=VICTIM)[-1][0] == "result"
        started = status(url, victim, VICTIM)["started"]
        for job_id in queue:
            assert follow(url, job_id, token=ATTACKER)[-1][0] == "result"
        later = [status(url, j, ATTACKER)["started"] for j in queue]
        # ISO-8601 UTC times of the server's own claims: the victim's came first
        assert all(t > started for t in later), (started, later)
    finally:
        stop(srv)


# --- the function's version --------------------------------------------------------------
def test_a_job_computes_the_function_version_it_was_submitted_with(tmp_path: Path) -> None:
    srv = server(tmp_path, "version")
    try:
        url = srv.url
        r = httpx.post(
            f"{url}/functions",
            json={"name": "versioned", "expression": "jnp.sum(x**2)", "args": ["x"]},
        )
        assert r.status_code == 201, r.text
        running = busy_runner(url, None)
        x = [1.0, 2.0, 3.0]
        job = submit(url, "gradient", {"function": "versioned", "x": x}, token=None)
        r = httpx.post(
            f"{url}/functions",
            json={
                "name": "versioned",
                "expression": "jnp.sum(x**3)",
                "args": ["x"],
                "replace": True,
            },
        )
        assert r.status_code in (200, 201), r.text
        assert status(url, job["id"], None)["status"] == "queued"  # replaced while it waits
        plain = httpx.post(f"{url}/gradient", json={"function": "versioned", "x": x})
        np.testing.assert_allclose(plain.json()["gradient"], [3.0, 12.0, 27.0], rtol=1e-12)
        assert httpx.delete(f"{url}/jobs/{running['id']}").status_code == 202
        found = follow(url, job["id"], token=None)
        assert found[-1][0] == "result", found[-1]
        fetched = httpx.get(f"{url}/jobs/{job['id']}/result").json()
        np.testing.assert_allclose(fetched["gradient"], [2.0, 4.0, 6.0], rtol=1e-12)
    finally:
        stop(srv)


# --- restarts ----------------------------------------------------------------------------
@pytest.mark.slow  # a restart
def test_a_directory_stores_half_written_files_are_removed_on_restart(tmp_path: Path) -> None:
    """What a process killed mid-write leaves in a directory store (a partial result's
    temporary file, a job directory without its record) is gone once it restarts."""
    root = tmp_path / "dirstore"
    args = ("--store", f"dir://{root}")
    env = {"DXSERVE_WARM_UP": "false", "DXSERVE_JOB_POLL_INTERVAL": "0.2"}
    srv = start_server(tmp_path / "dir1", env=env, args=args, modules=MODULES)
    try:
        job = submit(srv.url, "gradient", {"function": "rosenbrock", "x": [1.0, 2.0]}, token=None)
        assert follow(srv.url, job["id"], token=None)[-1][0] == "result"
    finally:
        stop(srv)
    jobs = root / "jobs"
    partial = jobs / job["id"] / ".tmp-result-killed.tmp"
    partial.write_bytes(b"\0" * 100_000)
    orphan = jobs / "half-created-job"
    orphan.mkdir()
    (orphan / "body").write_bytes(b"\0" * 100_000)
    srv = start_server(tmp_path / "dir2", env=env, args=args, modules=MODULES)
    try:
        assert not partial.exists() and not orphan.exists()
        r = httpx.get(f"{srv.url}/jobs/{job['id']}/result")
        assert r.status_code == 200 and r.json()["gradient"]
    finally:
        stop(srv)
