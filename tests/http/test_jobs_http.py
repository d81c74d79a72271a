"""Detached jobs over real HTTP (``POST /jobs/{operator}`` and ``/jobs/...``).

Real ``dxserve serve`` processes on free ports. A chunked Hessian submitted with no
connection kept, followed and fetched, is the plain call's answer bit for bit in every
encoding; the events are a streamed operator's and closing them cancels nothing; a
queued and a running job are cancelled; another token (or none) can neither see, fetch
nor cancel a job; past the jobs per token a 429 and past the job store's bytes (a
job's expected result counted at submission) a 507, and every job acknowledged still
ends with its result; bad ids and bad bodies get
problem documents, never a 5xx. Tests wait on job events, never on the clock.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np
import pytest

from dxcontract import codec
from tests.conftest import ServerProcess, start_server, stop_server
from tests.references import rosenbrock_hessian
from tests.slow_functions import heavy_sines_hessian

SSE = "text/event-stream"
SSE_B64 = "text/event-stream; arrays=b64"
PROBLEM = "application/problem+json"
ALICE, BOB = "alice-token-0123456789", "bob-token-0123456789"
#: a Hessian of 20 chunks taking seconds: a job that is running while a test acts on it
HEAVY_N = 1200
HEAVY = {"function": "heavy_sines", "backend": {"type": "jax-forward", "batch_size": 60},
         "x": np.linspace(0.1, 1.3, HEAVY_N).tolist()}


@pytest.fixture(scope="module")
def jobs_server(tmp_path_factory: pytest.TempPathFactory):
    """Two tokens, one job at a time per process, short leases and polls."""
    work = tmp_path_factory.mktemp("jobs")
    tokens = work / "tokens"
    tokens.write_text(f"{ALICE}\n{BOB}\n")
    srv = start_server(work / "server", env={
        "DXSERVE_TOKENS_FILE": str(tokens), "DXSERVE_WARM_UP": "false",
        "DXSERVE_JOB_RUNNERS": "1", "DXSERVE_JOB_POLL_INTERVAL": "0.2",
    }, modules=("dxserve.examples", "tests.slow_functions"))
    yield srv
    stop_server(srv)


def auth(token: str | None) -> dict[str, str]:
    return {"authorization": f"Bearer {token}"} if token else {}


def submit(url: str, operator: str, body: dict, token: str | None = ALICE, **headers) -> dict:
    r = httpx.post(f"{url}/jobs/{operator}", json=body, headers={**auth(token), **headers})
    assert r.status_code == 202, r.text
    doc = r.json()
    assert r.headers["location"] == f"/jobs/{doc['id']}"
    assert doc["status"] == "queued" and doc["operator"] == operator
    return doc


def follow(url: str, job_id: str, token: str | None = ALICE, accept: str = SSE,
           stop: Callable[[str, str], bool] | None = None) -> list[tuple[str, str]]:
    """The job's events until it ends (or ``stop(event, data)`` says so: the stream is
    closed then); comments as ``(":", text)``."""
    found: list[tuple[str, str]] = []
    with httpx.stream("GET", f"{url}/jobs/{job_id}/events",
                      headers={"accept": accept, **auth(token)}, timeout=300) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith(SSE)
        name, data = "message", []
        for line in r.iter_lines():
            if line.startswith(":"):
                found.append((":", line))
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif not line and data:
                found.append((name, "\n".join(data)))
                if name in ("result", "error") or (stop and stop(name, found[-1][1])):
                    return found
                name, data = "message", []
    return found


def status(url: str, job_id: str, token: str | None = ALICE) -> dict:
    r = httpx.get(f"{url}/jobs/{job_id}", headers=auth(token))
    assert r.status_code == 200, r.text
    return r.json()


def is_problem(r: httpx.Response, status_code: int, slug: str | None = None) -> dict:
    assert r.status_code == status_code, (r.status_code, r.text)
    assert r.headers["content-type"].startswith(PROBLEM), r.headers
    doc = r.json()
    assert doc["status"] == status_code and doc["detail"]
    if slug is not None:
        assert doc["type"].endswith(slug), doc
    return doc


def progress_of(found: list) -> list[dict]:
    return [json.loads(d) for e, d in found if e == "progress"]


# --- results, bit for bit ----------------------------------------------------------------
def test_a_chunked_hessian_job_equals_the_plain_call_in_every_encoding(jobs_server) -> None:
    url = jobs_server.url
    x = np.linspace(0.1, 1.3, 2000)
    body = {"function": "rosenbrock", "backend": "jax-forward", "x": x.tolist()}
    job = submit(url, "hessian", body)  # nothing held open: the job runs on its own
    deadline = time.monotonic() + 300
    while (done := status(url, job["id"]))["status"] in ("queued", "running"):  # polled
        assert time.monotonic() < deadline, done
        time.sleep(0.05)
    assert done["status"] == "succeeded" and done["progress"] == {
        "done": 2000, "total": 2000, "unit": "columns"}
    assert done["chunks"] == {"computed": 10, "restored": 0} and done["attempts"] == 1
    assert done["timings"]["running_seconds"] > 0 and done["finished"] and done["expires"]
    for accept in (codec.BINARY_TYPE, "application/json; arrays=b64", "application/json"):
        fetched = httpx.get(f"{url}/jobs/{job['id']}/result",
                            headers={"accept": accept, **auth(ALICE)})
        plain = httpx.post(f"{url}/hessian", json=body, headers={"accept": accept})
        assert fetched.status_code == plain.status_code == 200, fetched.text
        assert fetched.headers["content-type"] == plain.headers["content-type"]
        assert fetched.content == plain.content, accept  # the same bytes: the same bits
    H = codec.decode_result(fetched.json()["hessian"], "hessian")
    np.testing.assert_allclose(H, rosenbrock_hessian(x), rtol=1e-10, atol=1e-9)
    assert done["result_bytes"] >= 2000 * 2000 * 8


@pytest.mark.parametrize("encoding", ["binary", "b64", "json"])
def test_a_job_takes_every_encoding_and_answers_in_it(jobs_server, encoding: str) -> None:
    url = jobs_server.url
    x = np.linspace(-0.5, 0.7, 9)
    payload = {"function": "rosenbrock", "backend": "jax-reverse", "x": x}
    body, content_type, headers = codec.encode_body(payload, encoding)
    headers = {"content-type": content_type, **headers}
    r = httpx.post(f"{url}/jobs/value_gradient_and_hessian", content=body,
                   headers={**headers, **auth(ALICE)})
    assert r.status_code == 202, r.text
    job_id = r.json()["id"]
    assert follow(url, job_id)[-1][0] == "result"
    fetched = httpx.get(f"{url}/jobs/{job_id}/result", headers=auth(ALICE))
    plain = httpx.post(f"{url}/value_gradient_and_hessian", content=body, headers=headers)
    assert fetched.headers["content-type"] == plain.headers["content-type"]
    assert fetched.content == plain.content
    out = codec.decode_response(
        fetched.content, fetched.headers["content-type"],
        fetched.headers.get(codec.HEADER_LENGTH), arrays=("hessian",),
    )
    np.testing.assert_allclose(np.asarray(out["hessian"]), rosenbrock_hessian(x), rtol=1e-12)


def test_events_are_a_streamed_operators_and_closing_them_cancels_nothing(jobs_server) -> None:
    url = jobs_server.url
    job = submit(url, "hessian", HEAVY)
    # closed after the first chunk's progress: the job goes on
    early = follow(url, job["id"], stop=lambda e, d: e == "progress" and json.loads(d)["done"] > 0)
    assert early[-1][0] == "progress"
    found = follow(url, job["id"], accept=SSE_B64)
    steps = progress_of(found)
    dones = [s["done"] for s in steps]
    assert dones == sorted(dones) and dones[-1] == HEAVY_N
    assert all(s["total"] == HEAVY_N and s["unit"] == "columns" for s in steps)
    assert [e for e, _ in found if e in ("result", "error")] == ["result"]
    streamed = json.loads(found[-1][1])
    plain = httpx.post(f"{url}/hessian", json=HEAVY, headers={"accept": "application/json; "
                                                               "arrays=b64"}, timeout=300)
    assert streamed == plain.json()  # typed base64: the same bits
    H = codec.decode_result(streamed["hessian"], "hessian")
    np.testing.assert_allclose(H, heavy_sines_hessian(np.asarray(HEAVY["x"])), rtol=1e-9,
                               atol=1e-9)
    assert status(url, job["id"])["chunks"]["computed"] == 20


# --- cancelling ---------------------------------------------------------------------------
def test_cancel_a_queued_job_and_a_running_job(jobs_server) -> None:
    url = jobs_server.url
    running = submit(url, "hessian", HEAVY)
    queued = submit(url, "hessian", HEAVY)  # one runner: this one waits for the first
    r = httpx.get(f"{url}/jobs/{queued['id']}/result", headers=auth(ALICE))
    doc = is_problem(r, 409, "job-not-finished")
    assert doc["job_status"] == "queued" and int(r.headers["retry-after"]) >= 1
    r = httpx.delete(f"{url}/jobs/{queued['id']}", headers=auth(ALICE))
    assert r.status_code == 202 and r.json()["status"] == "cancelled"
    is_problem(httpx.get(f"{url}/jobs/{queued['id']}/result", headers=auth(ALICE)), 409,
               "job-cancelled")
    # the running one: cancelled once it has computed a chunk, it stops at the next
    follow(url, running["id"], stop=lambda e, d: e == "progress" and json.loads(d)["done"] > 0)
    r = httpx.delete(f"{url}/jobs/{running['id']}", headers=auth(ALICE))
    assert r.status_code == 202 and r.json()["cancel_requested"] is True
    found = follow(url, running["id"])
    error = json.loads(found[-1][1])
    assert found[-1][0] == "error" and error["type"].endswith("job-cancelled")
    ended = status(url, running["id"])
    assert ended["status"] == "cancelled" and ended["chunks"]["computed"] < 20
    # removed once ended; then there is no such job
    for job in (queued, running):
        assert httpx.delete(f"{url}/jobs/{job['id']}", headers=auth(ALICE)).status_code == 204
        is_problem(httpx.get(f"{url}/jobs/{job['id']}", headers=auth(ALICE)), 404, "unknown-job")
    # the runner is free again
    after = submit(url, "gradient", {"function": "rosenbrock", "x": [1.0, 2.0, 3.0]})
    assert json.loads(follow(url, after["id"])[-1][1]) == {"gradient": [-400.0, 1002.0, -200.0]}


# --- ownership ------------------------------------------------------------------------------
def test_another_token_cannot_see_fetch_or_cancel_a_job(jobs_server) -> None:
    url = jobs_server.url
    job = submit(url, "gradient", {"function": "rosenbrock", "x": [1.0, 2.0, 3.0]})
    follow(url, job["id"])
    for token in (BOB, None):
        for method, path in (("GET", ""), ("GET", "/result"), ("GET", "/events"),
                             ("DELETE", "")):
            r = httpx.request(method, f"{url}/jobs/{job['id']}{path}", headers=auth(token))
            is_problem(r, 404, "unknown-job")
        listed = httpx.get(f"{url}/jobs", headers=auth(token)).json()
        assert job["id"] not in {j["id"] for j in listed["jobs"]}
    r = httpx.get(f"{url}/jobs/{job['id']}", headers=auth("not-a-token"))
    is_problem(r, 401, "unauthorized")
    mine = httpx.get(f"{url}/jobs", headers=auth(ALICE)).json()
    assert job["id"] in {j["id"] for j in mine["jobs"]}
    assert httpx.get(f"{url}/jobs/{job['id']}/result", headers=auth(ALICE)).json() == {
        "gradient": [-400.0, 1002.0, -200.0]}


def test_pages_of_jobs_newest_first(jobs_server) -> None:
    url = jobs_server.url
    ids = [submit(url, "value", {"function": "rosenbrock", "x": [float(i), 1.0]}, token=BOB)["id"]
           for i in range(3)]
    seen: list[str] = []
    after = None
    while True:
        params = {"limit": 2, **({"after": after} if after else {})}
        page = httpx.get(f"{url}/jobs", params=params, headers=auth(BOB)).json()
        seen += [j["id"] for j in page["jobs"]]
        after = page["next"]
        if after is None:
            break
    assert seen[:3] == ids[::-1]
    for job_id in ids:
        assert follow(url, job_id, token=BOB)[-1][0] == "result"


# --- problem documents ----------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["x", "..%2F..%2Fetc", "a" * 300, "%E2%9C%93" * 10, "%00" * 12])
def test_bad_job_ids_are_404_problems(jobs_server, bad: str) -> None:
    url = jobs_server.url
    for method, path in (("GET", ""), ("GET", "/result"), ("GET", "/events"), ("DELETE", "")):
        r = httpx.request(method, f"{url}/jobs/{bad}{path}", headers=auth(ALICE))
        assert r.status_code == 404, (method, path, r.status_code, r.text)
        assert r.headers["content-type"].startswith(PROBLEM)


def test_bad_bodies_and_queries_are_problems_and_nothing_is_stored(jobs_server) -> None:
    url = jobs_server.url
    before = httpx.get(f"{url}/jobs", headers=auth(ALICE), params={"limit": 100}).json()["jobs"]
    cases = [
        ("/jobs/hessian", b"{", "application/json", 400, "malformed-request", "body"),
        ("/jobs/hessian", b'{"function": "rosenbrock"}', "application/json", 422, None, "x"),
        ("/jobs/hessian", b'{"function": "nope", "x": [1.0, 2.0]}', "application/json", 404,
         "unknown-function", "function"),
        ("/jobs/hessian", b'{"function": "rosenbrock", "x": [1.0, 2.0], "prep": "abc"}',
         "application/json", 422, "invalid-argument", "prep"),
        ("/jobs/hessian", b"x=1", "text/plain", 415, "unsupported-media-type", "Content-Type"),
        ("/jobs/hesian", b'{"function": "rosenbrock", "x": [1.0]}', "application/json", 404,
         "not-found", None),
        ("/jobs/hvp", b'{"function": "rosenbrock", "x": [1.0, 2.0], "tangents": "no"}',
         "application/json", 400, None, "tangents"),
    ]
    for path, body, media, code, slug, field in cases:
        r = httpx.post(url + path, content=body, headers={"content-type": media, **auth(ALICE)})
        doc = is_problem(r, code, slug)
        if field is not None:
            assert doc.get("field", "").startswith(field), (path, body, doc)
    assert "hessian" in httpx.post(f"{url}/jobs/hesian", json={}, headers=auth(ALICE)).json()[
        "detail"]
    for params in ({"limit": 0}, {"limit": 101}, {"limit": "many"}, {"after": "not-a-cursor"}):
        r = httpx.get(f"{url}/jobs", params=params, headers=auth(ALICE))
        is_problem(r, 422)
    is_problem(httpx.post(f"{url}/jobs", headers=auth(ALICE)), 405)
    is_problem(httpx.put(f"{url}/jobs/abcdefghij", headers=auth(ALICE)), 405)
    after = httpx.get(f"{url}/jobs", headers=auth(ALICE), params={"limit": 100}).json()["jobs"]
    assert len(after) == len(before)


def test_a_failed_job_answers_with_its_own_problem(jobs_server) -> None:
    url = jobs_server.url
    # sin_cumsum is vector-valued: no Hessian (the plain call's 422, found when it runs)
    job = submit(url, "hessian", {"function": "sin_cumsum", "x": [1.0, 2.0]})
    found = follow(url, job["id"])
    assert found[-1][0] == "error"
    plain = httpx.post(f"{url}/hessian", json={"function": "sin_cumsum", "x": [1.0, 2.0]})
    fetched = httpx.get(f"{url}/jobs/{job['id']}/result", headers=auth(ALICE))
    assert fetched.status_code == plain.status_code == 422
    assert fetched.json() == plain.json() == json.loads(found[-1][1])
    failed = status(url, job["id"])
    assert failed["status"] == "failed" and failed["error"] == plain.json()


def test_metrics_count_jobs_by_status(jobs_server) -> None:
    text = httpx.get(f"{jobs_server.url}/metrics").text
    counts = dict(re.findall(r'^dxserve_jobs\{status="(\w+)"\} ([0-9.]+)$', text, re.M))
    assert set(counts) == {"queued", "running", "succeeded", "failed", "cancelled"}
    assert float(counts["succeeded"]) >= 1


# --- limits -------------------------------------------------------------------------------
def test_quotas_429_and_507_and_nothing_acknowledged_is_lost(tmp_path: Path) -> None:
    srv: ServerProcess = start_server(tmp_path / "limits", env={
        "DXSERVE_WARM_UP": "false", "DXSERVE_JOB_RUNNERS": "1",
        "DXSERVE_MAX_JOBS_PER_TOKEN": "2", "DXSERVE_JOB_STORE_BYTES": "12000000",
        "DXSERVE_JOB_POLL_INTERVAL": "0.2",
    }, modules=("dxserve.examples", "tests.slow_functions"))
    try:
        url = srv.url
        x = np.linspace(0.1, 1.3, 160)  # a 160 x 160 Hessian: 204,800 bytes
        small = {"function": "rosenbrock", "backend": "jax-forward", "x": x.tolist()}
        first = submit(url, "hessian", HEAVY, token=None)  # 11.5 MB of result reserved
        second = submit(url, "hessian", small, token=None)
        r = httpx.post(f"{url}/jobs/hessian", json=small)
        doc = is_problem(r, 429, "too-many-jobs")
        assert doc["limit"] == "max_jobs_per_token" and "DXSERVE_MAX_JOBS_PER_TOKEN" in doc["detail"]
        assert httpx.delete(f"{url}/jobs/{first['id']}").status_code == 202
        # both acknowledged jobs end: one cancelled, one with its whole result
        assert follow(url, first["id"], token=None)[-1][0] == "error"
        assert follow(url, second["id"], token=None)[-1][0] == "result"
        # a 1300 x 1300 Hessian (13.5 MB) is past the limit: refused before it runs
        big = {**small, "x": np.linspace(0.1, 1.3, 1300).tolist()}
        r = httpx.post(f"{url}/jobs/hessian", json=big)
        doc = is_problem(r, 507, "insufficient-storage")
        assert doc["limit"] == "job_store_bytes" and "DXSERVE_JOB_STORE_BYTES" in doc["detail"]
        assert doc["needed"] > 1300 * 1300 * 8
        fetched = httpx.get(f"{url}/jobs/{second['id']}/result",
                            headers={"accept": codec.BINARY_TYPE})
        plain = httpx.post(f"{url}/hessian", json=small, headers={"accept": codec.BINARY_TYPE})
        assert fetched.content == plain.content
        # fetched and removed: room again
        assert httpx.delete(f"{url}/jobs/{second['id']}").status_code == 204
        third = submit(url, "hessian", small, token=None)
        assert follow(url, third["id"], token=None)[-1][0] == "result"
    finally:
        stop_server(srv)
