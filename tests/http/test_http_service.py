"""The service around the operators, against the real server (and in process).

Liveness under load, the registry and service routes, metrics, preparation
handles, content negotiation, NaN on the wire, bearer tokens, and the in-process
transports (ASGI for the async client, Starlette's TestClient for the sync one).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import sys
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from dxclient import AsyncClient, Client, FiniteDifferences, JaxReverse
from dxcontract import codec
from tests.conftest import LIVENESS_TIMEOUT

PROBLEM = "application/problem+json"
JSON = {"content-type": "application/json"}
OPERATOR_NAMES = (
    "value", "derivative", "gradient", "jacobian", "hessian", "pushforward", "pullback", "hvp",
)  # fmt: skip
EXAMPLES = {
    "rosenbrock", "sum_of_squares", "sin_cumsum", "tanh_layer", "softmax", "least_squares",
    "normal_logpdf",
}  # fmt: skip


def rosenbrock_gradient(x: np.ndarray) -> np.ndarray:
    """By hand: d/dx of sum 100 (x[i+1] - x[i]^2)^2 + (1 - x[i])^2."""
    g = np.zeros_like(x)
    g[:-1] += -400.0 * x[:-1] * (x[1:] - x[:-1] ** 2) - 2.0 * (1.0 - x[:-1])
    g[1:] += 200.0 * (x[1:] - x[:-1] ** 2)
    return g


def strict_json(content: bytes) -> Any:
    """Parse as strict JSON: bare NaN / Infinity tokens are errors."""

    def reject(name: str) -> Any:
        raise ValueError(f"invalid JSON constant {name}")

    return json.loads(content, parse_constant=reject)


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


# --- liveness under load -------------------------------------------------------------


@pytest.mark.slow
def test_health_answers_while_a_long_jacobian_runs(server: Any) -> None:
    """The event loop answers every /health within the probe's timeout while the
    worker computes (a blocked event loop would cost seconds). How fast it answers is
    measured in ``bench/health_latency.py``, not asserted on a busy machine."""
    n = 2400
    rng = np.random.default_rng(0)
    W = rng.normal(size=(n, n)) / math.sqrt(n)
    x = np.linspace(-1.0, 1.0, n)
    # one column per call (batch_size=1): ~2n matrix-vector products, several seconds
    backend = FiniteDifferences(batch_size=1)
    result: dict[str, Any] = {}

    def long_job() -> None:
        with Client(server.url, timeout=300) as client:
            t0 = time.perf_counter()
            try:
                result["jacobian"] = client.jacobian("tanh_layer", backend, x, W)
            except BaseException as exc:  # reported by the main thread
                result["error"] = exc
            result["seconds"] = time.perf_counter() - t0

    def probe_health(http: httpx.Client) -> None:
        for _ in range(50):
            r = http.get("/health", timeout=LIVENESS_TIMEOUT)  # a timeout fails the test
            assert r.status_code == 200 and r.json() == {"status": "ok"}
            time.sleep(0.01)

    with httpx.Client(base_url=server.url) as http:
        http.get("/health")  # open the keep-alive connection first
        thread = threading.Thread(target=long_job, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while http.get("/ready").json()["queued"] < 1:  # the job reached the worker
            assert thread.is_alive() and time.monotonic() < deadline, result
            time.sleep(0.01)

        probe_health(http)
        still_running = http.get("/ready").json()["queued"] >= 1 and thread.is_alive()
    thread.join(timeout=300)

    assert "error" not in result, result.get("error")
    assert still_running, f"the Jacobian finished too early ({result.get('seconds')} s)"
    # J = diag(1 - tanh(W x)^2) W
    expected = (1.0 - np.tanh(W @ x) ** 2)[:, None] * W
    np.testing.assert_allclose(result["jacobian"], expected, rtol=1e-5, atol=1e-8)


# --- registry and service routes ------------------------------------------------------


def test_functions_list_and_get(server: Any) -> None:
    with httpx.Client(base_url=server.url) as http:
        listed = http.get("/functions", params={"details": "true"}).json()["functions"]
        by_name = {f["name"]: f for f in listed}
        assert EXAMPLES <= set(by_name)
        assert [f["name"] for f in listed] == sorted(by_name)
        for name in EXAMPLES:
            info = by_name[name]
            assert info["kind"] == "module"
            assert info["description"]
            assert info["signature"]["args"][0] in ("x", "params")
        assert by_name["tanh_layer"]["signature"] == {"args": ["x", "W"]}
        assert by_name["least_squares"]["signature"] == {"args": ["params", "X", "Y"]}

        one = http.get("/functions/rosenbrock")
        assert one.status_code == 200
        assert one.json() == by_name["rosenbrock"]

        missing = http.get("/functions/no_such_function")
        assert missing.status_code == 404
        assert missing.headers["content-type"] == PROBLEM
        assert missing.json()["field"] == "name"


def test_backends(server: Any) -> None:
    backends = httpx.get(server.url + "/backends").json()["backends"]
    by_type = {b["type"]: b for b in backends}
    assert set(by_type) == {
        "jax-forward", "jax-reverse", "torch-forward", "torch-reverse", "finite-differences",
        "second-order", "auto", "sparse",
    }
    has_torch = importlib.util.find_spec("torch") is not None
    for name in ("torch-forward", "torch-reverse"):  # listed, and whether this server has it
        assert by_type[name]["framework"] == "torch"
        assert by_type[name]["installed"] is has_torch
    assert set(by_type["jax-forward"]["parameters"]) == {"batch_size"}
    assert set(by_type["jax-reverse"]["parameters"]) == {"batch_size"}
    assert set(by_type["finite-differences"]["parameters"]) == {"method", "step", "batch_size"}
    assert set(by_type["second-order"]["parameters"]) == {"outer", "inner"}
    assert by_type["auto"]["parameters"] == {}
    for b in backends:
        assert isinstance(b["operators"], list) and b["operators"]
    for first_order in ("jax-forward", "jax-reverse", "finite-differences", "auto"):
        assert set(OPERATOR_NAMES) <= set(by_type[first_order]["operators"])
    assert set(by_type["second-order"]["operators"]) == {
        "second_derivative", "value_derivative_and_second_derivative", "hessian",
        "value_gradient_and_hessian", "hvp", "gradient_and_hvp",
    }  # fmt: skip


def test_ready(server: Any) -> None:
    ready = httpx.get(server.url + "/ready").json()
    assert ready["status"] == "ready"
    assert ready["platform"] in ("cpu", "gpu", "tpu")
    assert isinstance(ready["devices"], list) and ready["devices"]
    assert ready["export_platforms"] and set(ready["export_platforms"]) <= {"cpu", "cuda", "tpu"}
    assert ready["functions"] >= len(EXAMPLES)


def test_metrics(server: Any) -> None:
    body = {"function": "sum_of_squares", "backend": "jax-reverse", "x": [1.0, 2.0, 3.0, 4.5]}
    with httpx.Client(base_url=server.url) as http:
        first = http.post("/gradient", json=body)
        assert first.json() == {"gradient": [2.0, 4.0, 6.0, 9.0]}
        before = http.get("/metrics")
        assert before.headers["content-type"].startswith("text/plain")
        for _ in range(3):
            assert http.post("/gradient", json=body).status_code == 200
        text = http.get("/metrics").text

    for name in ("dxserve_requests", "dxserve_request_seconds", "dxserve_compile_cache_hits",
                 "dxserve_compile_cache_misses"):  # fmt: skip
        assert f"# TYPE {name}" in text, name
    assert metric(text, "dxserve_requests_total", route="/gradient", status="200") >= 4
    assert metric(text, "dxserve_request_seconds_count", route="/gradient") >= 4
    hits_before = metric(before.text, "dxserve_compile_cache_hits_total")
    hits_after = metric(text, "dxserve_compile_cache_hits_total")
    assert hits_after >= hits_before + 3
    assert metric(text, "dxserve_compile_cache_misses_total") >= 1


def test_prepare_then_use_the_handle(server: Any) -> None:
    x = [0.5, -1.0, 2.0, 1.5]
    with httpx.Client(base_url=server.url) as http:
        r = http.post(
            "/prepare/gradient", json={"function": "rosenbrock", "backend": "auto", "x": x}
        )
        assert r.status_code == 200, r.text
        prep = r.json()
        assert set(prep) == {"prep", "operator", "function", "backend", "resolved", "reason"}
        assert prep["operator"] == "gradient" and prep["function"] == "rosenbrock"
        assert prep["backend"] == {"type": "auto"}
        assert prep["resolved"]["type"] == "jax-reverse"
        assert prep["reason"] == "auto's rule for gradient: reverse mode"
        for _ in range(2):
            g = http.post(
                "/gradient",
                json={"function": "rosenbrock", "backend": "auto", "x": x, "prep": prep["prep"]},
            )
            assert g.status_code == 200, g.text
            np.testing.assert_allclose(g.json()["gradient"], rosenbrock_gradient(np.array(x)))

        # value_and_gradient shares the gradient family's prep
        vg = http.post(
            "/value_and_gradient",
            json={"function": "rosenbrock", "backend": "auto", "x": x, "prep": prep["prep"]},
        )
        assert vg.status_code == 200, vg.text
        assert set(vg.json()) == {"value", "gradient"}

    # and through the client
    with Client(server.url) as client:
        handle = client.prepare_hvp("rosenbrock", "auto", np.array(x), (np.ones(4),))
        hv = client.hvp("rosenbrock", "auto", np.array(x), (np.ones(4),), prep=handle)
        plain = client.hvp("rosenbrock", "auto", np.array(x), (np.ones(4),))
        np.testing.assert_allclose(hv[0], plain[0])


# --- content negotiation --------------------------------------------------------------


def _binary_gradient_request(x: np.ndarray) -> tuple[bytes, dict[str, str]]:
    body, media, headers = codec.encode_body({"function": "rosenbrock", "x": x}, "binary")
    return body, {"content-type": media, **headers}


def test_accept_negotiation_and_mirroring(server: Any) -> None:
    x = np.array([1.0, 2.0, 3.0, 0.25])
    g = rosenbrock_gradient(x)
    with httpx.Client(base_url=server.url) as http:
        # binary in, binary out (mirror)
        body, headers = _binary_gradient_request(x)
        r = http.post("/gradient", content=body, headers=headers)
        assert r.headers["content-type"] == codec.BINARY_TYPE
        out = codec.decode_response(
            r.content, r.headers["content-type"], r.headers[codec.HEADER_LENGTH], arrays=["gradient"]
        )
        np.testing.assert_allclose(out["gradient"], g)

        # binary in, Accept JSON -> JSON lists
        r = http.post("/gradient", content=body, headers={**headers, "accept": "application/json"})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        assert codec.HEADER_LENGTH.lower() not in r.headers
        np.testing.assert_allclose(strict_json(r.content)["gradient"], g)

        # binary in, Accept JSON with base64 arrays
        r = http.post(
            "/gradient", content=body, headers={**headers, "accept": "application/json; arrays=b64"}
        )
        typed = r.json()["gradient"]
        assert set(typed) == {"__ndarray__", "dtype", "shape"}
        assert typed["dtype"] == "float64" and typed["shape"] == [4]
        np.testing.assert_allclose(codec.to_tree(typed, "gradient"), g)

        # JSON lists in, JSON lists out (mirror)
        lists = {"function": "rosenbrock", "x": x.tolist()}
        r = http.post("/gradient", json=lists)
        assert r.headers["content-type"] == "application/json"
        np.testing.assert_allclose(r.json()["gradient"], g)

        # JSON lists in, Accept binary -> binary
        r = http.post("/gradient", json=lists, headers={"accept": codec.BINARY_TYPE})
        assert r.headers["content-type"] == codec.BINARY_TYPE
        out = codec.decode_response(
            r.content, r.headers["content-type"], r.headers[codec.HEADER_LENGTH], arrays=["gradient"]
        )
        np.testing.assert_allclose(out["gradient"], g)

        # JSON lists in, Accept arrays=b64 -> typed base64
        r = http.post("/gradient", json=lists, headers={"accept": "application/json; arrays=b64"})
        assert isinstance(r.json()["gradient"]["__ndarray__"], str)

        # JSON with base64 arrays in -> base64 out (mirror), unless Accept asks for lists
        b64 = codec.dumps(codec.from_tree({"function": "rosenbrock", "x": x}, "b64"))
        r = http.post("/gradient", content=b64, headers=JSON)
        assert isinstance(r.json()["gradient"]["__ndarray__"], str)
        np.testing.assert_allclose(codec.to_tree(r.json()["gradient"], "gradient"), g)
        r = http.post(
            "/gradient", content=b64, headers={**JSON, "accept": "application/json; arrays=lists"}
        )
        np.testing.assert_allclose(r.json()["gradient"], g)

    # the client's three encodings agree
    for encoding in codec.ENCODINGS:
        with Client(server.url, encoding=encoding) as client:
            np.testing.assert_allclose(client.gradient("rosenbrock", JaxReverse(), x), g)


def test_nan_and_infinity_in_lists_mode_are_valid_json(server: Any) -> None:
    name = f"log_{uuid.uuid4().hex[:8]}"
    with httpx.Client(base_url=server.url) as http:
        r = http.post("/functions", json={"name": name, "expression": "jnp.log(x)"})
        assert r.status_code == 201, r.text
        assert r.json()["kind"] == "expression"
        assert r.json()["signature"] == {"args": ["x"], "expression": "jnp.log(x)"}

        r = http.post("/value", json={"function": name, "x": [-1.0, 0.0, 1.0]})
        assert r.status_code == 200, r.text
        assert r.headers["content-type"] == "application/json"
        value = strict_json(r.content)["value"]
        assert value == ["NaN", "-Infinity", 0.0]
        np.testing.assert_array_equal(
            codec.to_tree(value, "value"), np.array([np.nan, -np.inf, 0.0])
        )

        # 0-d results too, and NaN/Infinity spellings are accepted as input
        r = http.post("/value", json={"function": name, "x": -1.0})
        assert strict_json(r.content)["value"] == "NaN"
        r = http.post("/value", json={"function": name, "x": ["Infinity", "NaN"]})
        assert strict_json(r.content)["value"] == ["Infinity", "NaN"]

        assert http.delete(f"/functions/{name}").status_code == 200
        assert http.get(f"/functions/{name}").status_code == 404


# --- bearer tokens ------------------------------------------------------------------------


def test_token_guards_registry_writes_only(make_server: Callable[..., Any]) -> None:
    srv = make_server(env={"DXSERVE_TOKEN": "s3cret"})
    expr = {"name": "sq", "expression": "jnp.sum(x ** 2)"}
    with httpx.Client(base_url=srv.url) as http:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "s3cret"}):
            r = http.post("/functions", json=expr, headers=headers)
            assert r.status_code == 401, r.text
            assert r.headers["content-type"] == PROBLEM
            problem = r.json()
            assert problem["type"] == "urn:dxserve:problem:unauthorized"
            assert problem["field"] == "Authorization"
        assert http.get("/functions/sq").status_code == 404  # nothing was registered

        ok = {"authorization": "Bearer s3cret"}
        r = http.post("/functions", json=expr, headers=ok)
        assert r.status_code == 201, r.text
        r = http.post("/functions", json=expr, headers=ok)  # same content again
        assert r.status_code == 200, r.text

        # compute and reads stay open
        g = http.post("/gradient", json={"function": "sq", "x": [1.0, -2.0]})
        assert g.status_code == 200 and g.json() == {"gradient": [2.0, -4.0]}
        assert http.get("/functions").status_code == 200

        assert http.delete("/functions/sq").status_code == 401
        assert http.delete("/functions/sq", headers={"authorization": "Bearer nope"}).status_code == 401
        r = http.delete("/functions/sq", headers=ok)
        assert r.status_code == 200 and r.json() == {"deleted": "sq"}

    with Client(srv.url, token="s3cret") as client:
        f = client.register_expression("cube", "jnp.sum(x ** 3)")
        assert f.kind == "expression"
        np.testing.assert_allclose(client.gradient("cube", "auto", np.array([2.0])), [12.0])
        client.delete("cube")


# --- in process -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from dxserve.http import create_app
    from dxserve.settings import Settings

    store = tmp_path_factory.mktemp("inproc")
    return create_app(Settings(store=store, compilation_cache="", functions=["dxserve.examples"]))


def test_async_client_over_asgi_transport(app: Any) -> None:
    x = np.array([1.0, 2.0, 3.0])

    async def main() -> Any:
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://dxserve.test", transport=transport) as client:
            assert (await client.health()) == {"status": "ok"}
            g = await client.gradient("rosenbrock", JaxReverse(), x)
            v, gg = await client.value_and_gradient("rosenbrock", "auto", x)
            return g, v, gg

    g, v, gg = asyncio.run(main())
    np.testing.assert_allclose(g, rosenbrock_gradient(x))
    np.testing.assert_allclose(gg, rosenbrock_gradient(x))
    assert float(v) == pytest.approx(201.0)


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_sync_client_over_starlette_testclient(app: Any) -> None:
    from starlette.testclient import TestClient

    x = np.array([1.0, 2.0, 3.0])
    with TestClient(app) as http:
        client = Client(http=http)
        np.testing.assert_allclose(client.gradient("rosenbrock", "jax-reverse", x),
                                   rosenbrock_gradient(x))  # fmt: skip
        assert {b["type"] for b in client.backends()} >= {"auto", "second-order"}


@pytest.mark.filterwarnings("ignore:Using `httpx` with `starlette.testclient`")
def test_token_required_for_compute_when_configured(tmp_path: Any) -> None:
    from starlette.testclient import TestClient

    from dxserve.http import create_app
    from dxserve.settings import Settings

    settings = Settings(
        store=tmp_path, compilation_cache="", functions=["dxserve.examples"],
        token="s3cret", require_token_for_compute=True,
    )  # fmt: skip
    body = {"function": "sum_of_squares", "x": [1.0, 2.0]}
    with TestClient(create_app(settings)) as http:
        for path in ("/gradient", "/prepare/gradient"):
            r = http.post(path, json=body)
            assert r.status_code == 401, r.text
            assert r.headers["content-type"] == PROBLEM
            assert r.json()["field"] == "Authorization"
            r = http.post(path, json=body, headers={"authorization": "Bearer wrong"})
            assert r.status_code == 401
        r = http.post("/gradient", json=body, headers={"authorization": "Bearer s3cret"})
        assert r.status_code == 200 and r.json() == {"gradient": [2.0, 4.0]}
        assert http.get("/health").status_code == 200  # liveness needs no token


class _CountingFinder:
    """A meta-path finder that finds nothing and counts the imports that searched."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        self.names.append(name)
        return None


def test_async_client_calls_import_nothing(server: Any) -> None:
    """No module lookups per request: httpcore imports ``sniffio`` on every async call,
    and a missing ``sniffio`` (anyio>=4.11 stopped installing it) made each call search
    sys.path (encode/httpcore#1103); dxclient depends on it for that reason."""
    x = np.linspace(-1.0, 1.5, 8)

    async def calls() -> list[np.ndarray]:
        async with AsyncClient(server.url) as client:
            await client.gradient("rosenbrock", "jax-reverse", x)  # connect, warm up
            finder = _CountingFinder()
            sys.meta_path.insert(0, finder)
            try:
                got = [await client.gradient("rosenbrock", "jax-reverse", x) for _ in range(5)]
            finally:
                sys.meta_path.remove(finder)
            assert finder.names == [], f"imports searched on every call: {set(finder.names)}"
            return got

    for got in asyncio.run(calls()):
        np.testing.assert_allclose(got, rosenbrock_gradient(x), rtol=1e-12)
