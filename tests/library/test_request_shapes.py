"""Request shapes are bounded before anything is traced (``request_shapes``).

Real servers over real sockets: 16,000 tangents and a dict of 20,000 leaves (in x or
in a context) are refused with 422 ``request-shape`` naming the field and the setting,
and the server log shows nothing was compiled for them; requests exactly at each
bound (tangents, leaves, depth) are accepted with correct values; the bounds are
settings. The bounds themselves are checked in process too.
"""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from dxclient import Client
from dxcontract.errors import RequestShapeError
from dxserve.server.request_shapes import MAX_LEAVES, MAX_TANGENTS, ShapeLimits

X3 = [1.0, 2.0, 3.0]


def rosenbrock_hessian(x: np.ndarray) -> np.ndarray:
    n = len(x)
    h = np.zeros((n, n))
    for i in range(n - 1):
        h[i, i] += 1200 * x[i] ** 2 - 400 * x[i + 1] + 2
        h[i + 1, i + 1] += 200
        h[i, i + 1] = h[i + 1, i] = -400 * x[i]
    return h


def problem(r: httpx.Response) -> dict:
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    body = r.json()
    assert body["type"] == "urn:dxserve:problem:request-shape", body
    return body


def compiles(srv) -> list[str]:
    """The server's compile log lines, but the start-up warm-up's."""
    lines = srv.log.read_text(errors="replace").splitlines()
    return [line for line in lines if "compiled " in line and "_warm_up_function" not in line]


# --- over the defaults: refused at once ------------------------------------------------
def test_16000_tangents_and_20000_leaves_are_refused_before_tracing(make_server) -> None:
    srv = make_server()
    with httpx.Client(base_url=srv.url) as http:
        tangents = np.tile(np.eye(3), (16_000 // 3 + 1, 1))[:16_000].tolist()
        body = problem(http.post("/hvp", json={
            "function": "rosenbrock", "backend": "auto", "x": X3, "tangents": tangents,
        }))
        assert body["field"] == "tangents" and body["limit"] == "max_tangents"
        assert body["maximum"] == MAX_TANGENTS and body["count"] == 16_000
        assert "DXSERVE_MAX_TANGENTS" in body["detail"]

        params = {"w": [[1.0], [2.0]], "b": [0.5]}
        params.update({f"u{i}": [0.0, 1.0] for i in range(20_000)})
        X, Y = [[1.0, 2.0], [3.0, 4.0]], [[1.0], [2.0]]
        body = problem(http.post("/gradient", json={
            "function": "least_squares", "x": params, "contexts": [X, Y],
        }))
        assert body["field"] == "x" and body["limit"] == "max_leaves"
        assert body["maximum"] == MAX_LEAVES and "DXSERVE_MAX_LEAVES" in body["detail"]

        context = {f"c{i}": [1.0] for i in range(20_000)}
        body = problem(http.post("/gradient", json={
            "function": "tanh_layer", "x": X3, "contexts": [context],
        }))
        assert body["field"] == "contexts[0]" and body["limit"] == "max_leaves"

        # nothing was traced or compiled for any of them; the server still computes
        assert compiles(srv) == []
        r = http.post("/gradient", json={"function": "rosenbrock", "x": X3})
        assert r.json() == {"gradient": [-400.0, 1002.0, -200.0]}
        assert http.get("/health").json() == {"status": "ok"}


def test_hvp_at_the_tangent_limit_is_accepted_and_correct(server) -> None:
    rng = np.random.default_rng(0)
    x = np.array(X3)
    tangents = rng.normal(size=(MAX_TANGENTS, 3))
    with Client(server.url, timeout=300) as client:
        hvps = client.hvp("rosenbrock", "auto", x, list(tangents))
    assert len(hvps) == MAX_TANGENTS
    np.testing.assert_allclose(np.stack(hvps), tangents @ rosenbrock_hessian(x), rtol=1e-12)


# --- small bounds: at them accepted, past them refused -----------------------------------
def test_bounds_are_settings_exact_at_the_limit(make_server) -> None:
    srv = make_server(env={
        "DXSERVE_MAX_TANGENTS": "4", "DXSERVE_MAX_LEAVES": "8", "DXSERVE_MAX_DEPTH": "3",
    })
    X, Y = np.array([[1.0, 2.0], [3.0, 4.0], [0.5, -1.0]]), np.array([[1.0], [2.0], [0.0]])
    w, b = np.array([[0.3], [-0.2]]), np.array([0.1])
    residual = X @ w + b - Y
    grad_w, grad_b = X.T @ residual / 3, residual.sum(0) / 3

    def params(extra: int, deep: int = 0) -> dict:
        p = {"w": w.tolist(), "b": b.tolist()}
        p.update({f"u{i}": [float(i)] for i in range(extra)})
        if deep:
            node: object = [7.0]
            for _ in range(deep - 1):
                node = {"d": node}
            p["deep"] = node
        return p

    with httpx.Client(base_url=srv.url) as http:
        def gradient(p: dict) -> httpx.Response:
            return http.post("/gradient", json={
                "function": "least_squares", "x": p, "contexts": [X.tolist(), Y.tolist()],
            })

        # 6 leaves in x and 2 in the contexts: 8, the limit
        g = gradient(params(4)).json()["gradient"]
        np.testing.assert_allclose(g["w"], grad_w, rtol=1e-12)
        np.testing.assert_allclose(g["b"], grad_b, rtol=1e-12)
        assert all(g[f"u{i}"] == [0.0] for i in range(4))
        body = problem(gradient(params(5)))  # 9: the last context is one too many
        assert body["field"] == "contexts[1]" and body["limit"] == "max_leaves"
        assert body["maximum"] == 8 and "DXSERVE_MAX_LEAVES" in body["detail"]

        # depth: x is 1, its "deep" entry nests 2 more dicts: 3, the limit
        g = gradient(params(0, deep=3)).json()["gradient"]
        assert g["deep"] == {"d": {"d": [0.0]}}
        body = problem(gradient(params(0, deep=4)))
        assert body["field"] == "x" and body["limit"] == "max_depth"
        assert "DXSERVE_MAX_DEPTH" in body["detail"]

        ts = np.eye(3)[[0, 1, 2, 0]]
        r = http.post("/hvp", json={
            "function": "rosenbrock", "x": X3, "tangents": ts.tolist(),
        })
        np.testing.assert_allclose(r.json()["hvps"], ts @ rosenbrock_hessian(np.array(X3)))
        body = problem(http.post("/hvp", json={
            "function": "rosenbrock", "x": X3, "tangents": np.eye(3)[[0, 1, 2, 0, 1]].tolist(),
        }))
        assert body["field"] == "tangents" and body["maximum"] == 4 and body["count"] == 5

    # the client raises the typed error
    with Client(srv.url) as client, pytest.raises(RequestShapeError) as err:
        client.hvp("rosenbrock", "auto", np.array(X3), [np.ones(3)] * 5)
    assert err.value.field == "tangents"


# --- in process ------------------------------------------------------------------------
def test_limits_count_x_contexts_and_each_tangent() -> None:
    limits = ShapeLimits(max_tangents=3, max_leaves=4, max_depth=2)
    a = np.zeros(2)
    limits.check({"p": a, "q": a}, (a, a, a), (a, None))  # 2 + 1 + (1 per tangent) = 4
    limits.check([1.0, 2.0, 3.0, 4.0, 5.0], None, ())  # a list of numbers is one array
    with pytest.raises(RequestShapeError) as err:
        limits.check({"p": a, "q": a}, ({"p": a, "q": a, "r": a},), (a,))
    assert err.value.field == "tangents[0]" and err.value.extra["limit"] == "max_leaves"
    with pytest.raises(RequestShapeError) as err:
        limits.check(a, (a,) * 4, ())
    assert err.value.field == "tangents" and err.value.extra["count"] == 4
    limits.check({"a": {"b": a}}, None, ())  # depth 2
    with pytest.raises(RequestShapeError) as err:
        limits.check(a, None, ({"a": ({"b": a},)},))  # depth 3 in a context
    assert err.value.field == "contexts[0]" and err.value.extra["limit"] == "max_depth"
    limits.check({"a": {"b": {}}}, None, ())  # empty nodes hold no leaves at any depth
