"""The HTTP routes: each operator a plain ASGI endpoint first in the route table, every
request through the one middleware and the app's exception handlers.

Pinned here: problem documents for handled and unexpected errors (with the request's
id), the metrics labels, the 405 of other methods and the 404 of unknown paths, and the
clients' cached operator URLs.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from starlette.testclient import TestClient

from dxclient import Client, JaxReverse
from dxserve.http import create_app
from dxserve.http.operators import OperatorEndpoint, PrepareEndpoint
from dxserve.settings import Settings

PROBLEM = "application/problem+json"


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Any:
    store = tmp_path_factory.mktemp("dispatch")
    return create_app(Settings(store=Path(store), compilation_cache="", functions=["dxserve.examples"]))


@pytest.fixture(scope="module")
def http(app: Any) -> Iterator[TestClient]:
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client


def _count(text: str, route: str, status: int) -> float:
    found = re.search(
        rf'^dxserve_requests_total{{route="{re.escape(route)}",status="{status}"}} (\S+)$',
        text, re.M,
    )
    return float(found.group(1)) if found else 0.0


def test_operator_routes_come_first_and_are_plain_asgi_endpoints(
    app: Any, http: TestClient
) -> None:
    from dxcontract.operators import OPERATORS

    first = app.router.routes[: 2 * len(OPERATORS)]
    assert first[0].path == "/gradient"  # the most used first
    assert {r.path for r in first[: len(OPERATORS)]} == {f"/{n}" for n in OPERATORS}
    assert all(isinstance(r.endpoint, OperatorEndpoint | PrepareEndpoint) for r in first)
    ok = http.post("/gradient", json={"function": "rosenbrock", "x": [1.0, 2.0]})
    assert ok.status_code == 200 and ok.json()["gradient"] == [-400.0, 200.0]
    assert "x-request-id" in ok.headers and "server-timing" in ok.headers


def test_answers_and_metrics(http: TestClient) -> None:
    before = http.get("/metrics").text
    x = [1.0, 2.0, 3.0]
    ok = http.post("/gradient", json={"function": "rosenbrock", "backend": "jax-reverse", "x": x})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["gradient"]) == 3
    missing = http.post("/gradient", json={"function": "nope", "x": x})
    assert missing.status_code == 404
    assert missing.headers["content-type"] == PROBLEM
    assert missing.json()["field"] == "function"
    bad = http.post("/gradient", content=b"{", headers={"content-type": "application/json"})
    assert bad.status_code == 400 and bad.headers["content-type"] == PROBLEM
    after = http.get("/metrics").text
    for status in (200, 404, 400):
        assert _count(after, "/gradient", status) == _count(before, "/gradient", status) + 1


def test_other_methods_and_unknown_paths(http: TestClient) -> None:
    r = http.get("/gradient")
    assert r.status_code == 405
    assert r.headers["content-type"] == PROBLEM
    assert r.headers["allow"] == "POST"
    assert "x-request-id" in r.headers
    r = http.post("/jvp", json={})
    assert r.status_code == 404 and r.headers["content-type"] == PROBLEM
    assert r.json()["field"] == "path"
    r = http.post("/health")
    assert r.status_code == 405 and r.headers["allow"] == "GET"


def test_unexpected_error_is_a_logged_500_problem(
    app: Any, http: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("bug")

    monkeypatch.setattr(app.state.service.registry, "loaded", boom)
    before = http.get("/metrics").text
    r = http.post("/gradient", json={"function": "rosenbrock", "x": [1.0, 2.0]})
    assert r.status_code == 500
    assert r.headers["content-type"] == PROBLEM
    assert "RuntimeError" in r.json()["detail"]
    assert "x-request-id" in r.headers and "server-timing" in r.headers
    after = http.get("/metrics").text
    assert _count(after, "/gradient", 500) == _count(before, "/gradient", 500) + 1


def test_client_resolves_operator_urls_like_httpx(app: Any) -> None:
    """The cached URL is the one httpx would build, and follows a new base_url."""
    seen: list[str] = []
    transport = httpx.MockTransport(
        lambda request: seen.append(str(request.url)) or httpx.Response(404, json={})
    )
    http = httpx.Client(base_url="http://one/sub", transport=transport)
    client = Client(http=http)
    for base in ("http://one/sub", "http://two:81/"):
        http.base_url = base
        for _ in range(2):
            with pytest.raises(Exception):  # noqa: B017 - only the URL matters here
                client.gradient("f", JaxReverse(), np.zeros(2))
            assert seen[-1] == str(http.build_request("POST", "/gradient").url)
    assert seen == ["http://one/sub/gradient"] * 2 + ["http://two:81/gradient"] * 2


def test_repeated_json_frames_are_validated_once_and_never_wrongly(server) -> None:
    """JSON requests that repeat all but x reuse their validated fields; x (any shape)
    is validated every time, and a field of another type is never taken for one seen."""
    import json as _json

    from dxserve.pipeline import wire

    url = server.url + "/gradient"
    head = {"content-type": "application/json"}

    def post(body: dict) -> httpx.Response:
        return httpx.post(url, content=_json.dumps(body), headers=head)

    frame = {"function": "sum_of_squares", "backend": {"type": "jax-reverse"}}
    for x in ([1.0, 2.0], [3.0, -1.0, 0.5], [[1.0, 2.0], [0.0, -4.0]], 2.5):
        r = post({**frame, "x": x})
        assert r.status_code == 200, r.text
        assert np.array_equal(np.asarray(r.json()["gradient"]), 2 * np.asarray(x))
    # one shape in another dtype, then back: the signature kept for x is not reused
    typed = {"__ndarray__": [1.0, 2.0], "dtype": "float32", "shape": [2]}
    for x, dtype in ((typed, "float32"), ([1.0, 2.0], None), (typed, "float32")):
        r = post({**frame, "x": x})
        assert r.status_code == 200, r.text
        got = r.json()["gradient"]
        if dtype is None:
            assert got == [2.0, 4.0]
        else:
            assert (got["dtype"], got["__ndarray__"]) == (dtype, [2.0, 4.0])
    # the same fields with a bad x, or with fields of other types, are still refused
    assert post({**frame, "x": [1.0, "a"]}).status_code == 400
    assert post({**frame, "x": [1.0], "batch_axis": 0}).status_code == 200
    r = post({**frame, "x": [[1.0], [2.0]], "batch_axis": False})
    assert r.status_code == 422 and r.json()["field"] == "batch_axis"
    r = post({"function": 7, "backend": frame["backend"], "x": [1.0]})
    assert r.status_code == 422 and r.json()["field"] == "function"
    deep: dict = {"type": "jax-reverse"}
    for _ in range(300):
        deep = {"type": "second-order", "outer": deep}
    r = post({"function": "sum_of_squares", "backend": deep, "x": [1.0]})
    assert 400 <= r.status_code < 500
    r = post({**frame, "x": [1.0, 2.0], "contexts": [[1.0]]})  # not a frame: parsed in full
    assert 400 <= r.status_code < 500
    from dxcontract.operators import OPERATORS

    gradient = OPERATORS["gradient"]
    zero = wire._json_frame({**frame, "x": [1.0], "batch_axis": 0}, gradient)
    assert zero is not None
    assert wire._json_frame({**frame, "x": [1.0], "batch_axis": False}, gradient) != zero
    assert wire._json_frame({**frame, "x": [1.0], "tangents": [[1.0]]}, gradient) is None
    assert wire._json_frame({**frame, "x": [1.0], "function": "f" * 5000}, gradient) is None
