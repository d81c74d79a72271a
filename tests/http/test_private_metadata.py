"""``DXSERVE_PRIVATE_METADATA``: what a server holds (its functions, metrics and API
documents) is shown only to callers with a token; probes and computing stay open."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conftest import ServerProcess, start_server, stop_server
from tests.health_probe import HealthProbe

PRIVATE = ("/functions", "/functions/rosenbrock", "/metrics", "/docs", "/redoc", "/openapi.json")
OPEN = ("/health", "/ready")
TOKEN = "s3cret-token"


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server with a token and private metadata, shared: the tests only read from it."""
    srv = start_server(
        tmp_path_factory.mktemp("private"),
        env={"DXSERVE_TOKEN": TOKEN, "DXSERVE_PRIVATE_METADATA": "true"},
        modules=("dxserve.examples",),
    )
    try:
        yield srv
    finally:
        stop_server(srv)


def test_private_metadata_needs_the_token(private: ServerProcess) -> None:
    srv = private
    with httpx.Client(base_url=srv.url) as http:
        for path in PRIVATE:
            anonymous = http.get(path)
            assert anonymous.status_code == 401, (path, anonymous.text)
            assert anonymous.headers["content-type"] == "application/problem+json"
            assert anonymous.json()["field"] == "Authorization"
            wrong = http.get(path, headers={"authorization": "Bearer nope"})
            assert wrong.status_code == 401, path
            ok = http.get(path, headers={"authorization": f"Bearer {TOKEN}"})
            assert ok.status_code == 200, (path, ok.text)
        assert "rosenbrock" in {
            f["name"]
            for f in http.get("/functions", headers={"authorization": f"Bearer {TOKEN}"}).json()[
                "functions"
            ]
        }
        for path in OPEN:
            assert http.get(path).status_code == 200, path
        r = http.post("/gradient", json={"function": "rosenbrock", "x": [1.0, 2.0, 3.0]})
        assert r.json() == {"gradient": [-400.0, 1002.0, -200.0]}  # computing stays open


def test_private_metadata_without_a_token_is_closed_and_says_how_to_open(make_server: Any) -> None:
    srv = make_server(env={"DXSERVE_PRIVATE_METADATA": "true"})
    with httpx.Client(base_url=srv.url) as http:
        for path in PRIVATE:
            r = http.get(path)
            assert r.status_code == 403, path
            assert "DXSERVE_TOKEN" in r.json()["detail"]
        assert http.get("/health").status_code == 200


def test_metadata_is_open_by_default(server: Any) -> None:
    with httpx.Client(base_url=server.url) as http:
        for path in PRIVATE:
            assert http.get(path).status_code == 200, path


def test_private_metadata_names_no_function_in_a_404(private: ServerProcess) -> None:
    """An unknown function's 404 suggests no close names when they are private: the
    caller may be one who may not list them (with or without a token)."""
    srv = private
    with HealthProbe(srv.url) as probe, httpx.Client(base_url=srv.url) as http:
        for token in (None, "nope", TOKEN):
            headers = {"authorization": f"Bearer {token}"} if token else {}
            for route in ("/gradient", "/jobs/gradient", "/prepare/gradient"):
                r = http.post(
                    route, json={"function": "rosenbrok", "x": [1.0, 2.0]}, headers=headers
                )
                # jobs may need a token here (401 without a valid one)
                assert r.status_code in (401, 404), (route, r.text)
                assert r.headers["content-type"] == "application/problem+json"
                assert "rosenbrock" not in r.text and "did you mean" not in r.text, r.text
        probe.check()


def test_open_metadata_still_suggests_close_names(server: Any) -> None:
    r = httpx.post(f"{server.url}/gradient", json={"function": "rosenbrok", "x": [1.0, 2.0]})
    assert r.status_code == 404 and "'rosenbrock'" in r.json()["detail"], r.text
