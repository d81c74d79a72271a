"""Observability: request ids, ``Server-Timing``, JSON log lines, process metrics, routes
counted under their own names, and a bad setting's one-line message."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from dxclient import Client
from dxcontract.errors import UnknownFunctionError
from dxserve.http import create_app
from dxserve.settings import Settings

X = [1.0, 2.0, 3.0]
TIMING = re.compile(r"^[a-z]+;dur=\d+\.\d+$")


def _timing(header: str) -> dict[str, float]:
    parts = [p.strip() for p in header.split(",")]
    assert all(TIMING.match(p) for p in parts), header
    return {name: float(dur) for name, dur in (p.replace("dur=", "").split(";") for p in parts)}


@pytest.fixture(scope="module")
def app_client(tmp_path_factory: pytest.TempPathFactory):
    store = tmp_path_factory.mktemp("observe")
    settings = Settings(store=store / "store", compilation_cache="", executable_cache_mb=0)
    with TestClient(create_app(settings)) as client:
        yield client


def test_every_answer_has_request_id_and_server_timing(app_client: TestClient) -> None:
    answers = [
        app_client.post("/gradient", json={"function": "rosenbrock", "x": X}),
        app_client.post("/gradient", json={"function": "nope", "x": X}),
        app_client.get("/health"),
        app_client.get("/docs"),
        app_client.get("/no/such/path"),
        app_client.post("/prepare/hvp", json={"function": "rosenbrock", "x": X, "tangents": [X]}),
    ]
    assert [a.status_code for a in answers] == [200, 404, 200, 200, 404, 200]
    ids = [a.headers["x-request-id"] for a in answers]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)
    for answer in answers:
        assert "total" in _timing(answer.headers["server-timing"])
    split = _timing(answers[0].headers["server-timing"])
    assert {"total", "decode", "queue", "compute", "encode"} <= set(split)
    assert split["compute"] <= split["total"] + 1e-3
    assert {"decode", "encode"} <= set(_timing(answers[5].headers["server-timing"]))


def test_a_prepared_call_times_its_compute_apart(app_client: TestClient) -> None:
    # a prep handle's calls go the way requests are merged: compute is still their own
    body = {"function": "rosenbrock", "x": X, "tangents": [X]}
    prep = app_client.post("/prepare/hvp", json=body).json()["prep"]
    answer = app_client.post("/hvp", json={**body, "prep": prep})
    assert answer.status_code == 200, answer.text
    split = _timing(answer.headers["server-timing"])
    assert {"total", "decode", "queue", "compute", "encode"} <= set(split)
    assert split["queue"] + split["compute"] <= split["total"] + 1e-3


def test_unexpected_error_answer_has_the_headers(tmp_path) -> None:
    settings = Settings(store=tmp_path / "store", compilation_cache="", executable_cache_mb=0)
    app = create_app(settings)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False) as client:
        answer = client.get("/boom", headers={"x-request-id": "bug-1"})
        assert answer.status_code == 500
        assert answer.headers["x-request-id"] == "bug-1"
        assert "total" in _timing(answer.headers["server-timing"])
        assert 'route="/boom",status="500"' in client.get("/metrics").text


def test_request_id_is_echoed(app_client: TestClient) -> None:
    sent = "trace-4bf92f3577b34da6"
    answer = app_client.post(
        "/gradient", json={"function": "rosenbrock", "x": X}, headers={"x-request-id": sent}
    )
    assert answer.headers["x-request-id"] == sent
    too_long = "a" * 500  # not echoed: a new id instead
    answer = app_client.get("/health", headers={"x-request-id": too_long})
    assert answer.headers["x-request-id"] != too_long


def test_binary_client_answers_carry_the_headers(app_client: TestClient) -> None:
    seen: list[httpx.Response] = []
    app_client.event_hooks["response"] = [seen.append]
    try:
        client = Client(http=app_client)  # not closed: it would close the shared TestClient
        np.testing.assert_allclose(
            client.gradient("rosenbrock", "auto", np.array(X)), [-400.0, 1002.0, -200.0]
        )
    finally:
        app_client.event_hooks["response"] = []
    (answer,) = seen
    assert answer.headers["content-type"].startswith("application/vnd.dxserve.binary")
    assert answer.headers["x-request-id"] and "compute;dur=" in answer.headers["server-timing"]


def test_metrics_have_process_metrics_and_own_routes(app_client: TestClient) -> None:
    app_client.get("/docs")
    app_client.get("/openapi.json")
    app_client.get("/metrics")
    app_client.get("/no/such/path")
    text = app_client.get("/metrics").text
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "python_info"):
        assert re.search(rf"^{name}", text, re.M), name
    for route in ("/docs", "/openapi.json", "/metrics"):
        assert f'dxserve_requests_total{{route="{route}",status="200"}}' in text, route
    assert 'route="unmatched",status="404"' in text


def test_json_logs_parse_as_json_lines(make_server) -> None:
    srv = make_server(env={"DXSERVE_LOG_FORMAT": "json"})
    with Client(srv.url) as client:
        client.gradient("rosenbrock", "jax-reverse", np.array(X))
        client.register_expression("cubes", "jnp.sum(x ** 3)")
        with pytest.raises(UnknownFunctionError):
            client.gradient("missing", "auto", np.array(X))
    health = httpx.get(srv.url + "/health", headers={"x-request-id": "abc-123"})
    assert "server" not in health.headers and "date" in health.headers  # no stack banner
    deadline = time.monotonic() + 60
    while True:
        lines = [line for line in srv.log.read_text().splitlines() if line.strip()]
        records = [json.loads(line) for line in lines]  # every line is JSON
        events = {r.get("event") for r in records}
        health_logged = any(r.get("request_id") == "abc-123" for r in records)
        done = {"request", "rejected", "register", "compile"} <= events and health_logged
        if done or time.monotonic() > deadline:  # the last answer's line may come later
            break
        time.sleep(0.2)
    assert {"request", "rejected", "register", "compile"} <= events, events
    grad = next(r for r in records if r.get("event") == "request" and r.get("route") == "/gradient")
    assert grad["method"] == "POST" and grad["status"] == 200 and grad["seconds"] > 0
    assert grad["function"] == "rosenbrock" and grad["operator"] == "gradient"
    assert re.fullmatch(r"[0-9a-f]{16}", grad["request_id"])
    rejected = next(r for r in records if r.get("event") == "rejected")
    assert rejected["status"] == 404 and "unknown-function" in rejected["problem"]
    assert rejected["function"] == "missing"
    compiled = [r for r in records if r.get("event") == "compile"]
    assert all(r["seconds"] > 0 for r in compiled)
    assert any(r["operator"] == "gradient" and r["function"] == "rosenbrock" for r in compiled)
    registered = next(r for r in records if r.get("event") == "register")
    assert registered["function"] == "cubes" and registered["kind"] == "expression"
    assert any(r.get("request_id") == "abc-123" for r in records)


@pytest.mark.parametrize(
    ("env", "names"),
    [({"DXSERVE_PORT": "abc"}, ["DXSERVE_PORT", "int"]),
     ({"DXSERVE_MAX_BATCH": "3"}, ["DXSERVE_MAX_BATCH", "power of two"]),
     ({"DXSERVE_LOG_FORMAT": "xml"}, ["DXSERVE_LOG_FORMAT", "'text'", "'json'"])],
)
def test_bad_setting_is_one_clear_line(env: dict[str, str], names: list[str], tmp_path) -> None:
    child = {k: v for k, v in os.environ.items() if not k.startswith("DXSERVE_")}
    done = subprocess.run(
        [sys.executable, "-m", "dxserve.cli", "serve", "--store", str(tmp_path / "s")],
        env={**child, **env}, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert all(name in lines[0] for name in names), lines[0]
